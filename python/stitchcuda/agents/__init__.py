"""The StitchCUDA agents: the optimization loop (`optimize_problem`, in loop.py; the Planner, Coder,
VerifierAgent, Replanner and Optimizer themselves are C++) and its shared machinery — prompts shipped in
`prompts/`, code extraction, problem plans, the trajectories.jsonl record (trajectories.py), and retrieval: the Planner and Coder are shown the sections of a
documentation corpus (shipped in `corpus/`, or a folder of your own) that best match their task, ranked
with BM25 by the C++ `stitchcuda::agents::Retriever`.

    out = stitchcuda.agents.optimize_problem("problem.py", "openai:gpt-4.1", attempts=8)

    r = stitchcuda.agents.Retriever.default()
    for hit in r.search("vectorized loads for a memory-bound elementwise kernel", k=3):
        print(hit["id"], round(hit["score"], 2))
"""

from __future__ import annotations

import os

from .. import _C
from .loop import (BUDGET_DEFAULTS, CORPUS_DIR, NO_GPU, PROMPTS_DIR, ProblemPlan, PromptLibrary, docs_folder,
                   extract_code, hardware, optimize_problem, problem_plan_schema, report_from_json)
from .run_dir import RunDir
from .trajectories import (TRAJECTORY_KEYS, TRAJECTORY_SCHEMA, read_trajectories, trajectory_record,
                           validate_trajectory)

__all__ = ["Retriever", "RunDir", "CORPUS_DIR", "docs_folder", "PROMPTS_DIR", "NO_GPU", "BUDGET_DEFAULTS",
           "hardware", "extract_code", "ProblemPlan", "problem_plan_schema", "PromptLibrary", "report_from_json",
           "optimize_problem", "TRAJECTORY_SCHEMA", "TRAJECTORY_KEYS", "validate_trajectory", "read_trajectories",
           "trajectory_record"]


class Retriever:
    """BM25 over the `## ` sections of markdown files; each hit is {id, title, text, score}."""

    def __init__(self, native) -> None:
        self._r = native

    @classmethod
    def default(cls) -> "Retriever":
        """The shipped corpus, or the folder named by STITCHCUDA_DOCS_DIR."""
        return cls.from_folder(docs_folder())

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "Retriever":
        """Every *.md file of `folder` but README.md; NotFoundError / InvalidArgumentError say what is wrong."""
        return cls(_C.agents.Retriever.from_folder(os.fspath(folder)))

    @classmethod
    def from_documents(cls, documents: dict[str, str]) -> "Retriever":
        """Documents given as {name: markdown}."""
        return cls(_C.agents.Retriever.from_documents(list(documents.items())))

    def search(self, query: str, k: int = 3) -> list[dict]:
        """The k best sections for `query`, best first (only sections sharing a term with it)."""
        return self._r.search(query, k)

    def snippets(self) -> list[dict]:
        """Every indexed section, in document order."""
        return self._r.snippets()
