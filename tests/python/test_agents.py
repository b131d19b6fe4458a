"""Retrieval from Python: the shipped documentation corpus answers the questions a Planner or Coder asks
with the section written for them; a folder of one's own works the same way."""

from __future__ import annotations

import pytest

import stitchcuda
from stitchcuda.agents import CORPUS_DIR, Retriever


def test_own_documents():
    r = Retriever.from_documents({"notes": "# Notes\n\n## Tiling\nshared memory tiles\n\n## Graphs\ncapture once\n"})
    assert [s["id"] for s in r.snippets()] == ["notes#tiling", "notes#graphs"]
    assert r.search("capture a graph")[0]["id"] == "notes#graphs"


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(stitchcuda.NotFoundError, match="no documentation folder"):
        Retriever.from_folder(tmp_path / "nope")
    with pytest.raises(stitchcuda.InvalidArgumentError, match="no markdown"):
        Retriever.from_folder(tmp_path)


@pytest.mark.parametrize("query, document", [
    ("cuBLASLt epilogue with bias and GELU", "cublaslt_epilogues"),
    ("which ops to fuse: epilogue fusion into a GEMM", "fusion"),
    ("shared memory bank conflicts padding a tile", "shared_memory_tiling_and_bank_conflicts"),
    ("replay a captured CUDA graph to cut launch overhead", "cuda_graphs"),
    ("16-byte float4 vector loads coalesced", "coalescing_and_vector_loads"),
    ("warp shuffle reduction __shfl_xor_sync", "warp_reductions"),
    ("cp.async pipeline TMA bulk copy", "async_copies_and_tma"),
])
def test_the_shipped_corpus_answers_with_the_right_document(query, document):
    files = sorted(p.stem for p in CORPUS_DIR.glob("*.md") if p.name != "README.md")
    assert len(files) >= 10, files
    hits = Retriever.default().search(query, k=3)
    assert hits and hits[0]["id"].split("#")[0] == document, [h["id"] for h in hits]
