"""ProgramFamily and FamilyExecutor from Python: the family as data without a GPU (validation naming the
field, the member choice, the family file's round trip with shared weights stored once, damaged files,
the single-program loaders pointing at the family's), and on a GPU every size of the range run against
eager PyTorch: exact members, padded calls narrowed back, concurrent calls, add_member, max_resident.
"""

from __future__ import annotations

import threading

import pytest
import torch

import stitchcuda
from stitchcuda import Program, ProgramBuilder
from stitchcuda.errors import InvalidArgumentError, NotFoundError, UnavailableError
from stitchcuda.program import FamilyExecutor, FamilyModule, ProgramFamily

SCALE = torch.linspace(-2.0, 3.0, 8)
BATCH = dict(name="batch", min=1, max=8, pad=True, inputs=[(0, 0)], outputs=[(0, 0), (1, 0)])


def scaled(batch: int, seq: int = 4, scale: torch.Tensor = SCALE, *, shared: bool = False) -> Program:
    """y f32[batch, seq, 8] = x * scale; total f32[batch] = y summed per sample (a padded row adds nothing)."""
    b = ProgramBuilder()
    x = b.input([batch, seq, 8], name="x")
    w = b.weight([8], data=None, name="scale") if shared else b.weight(scale, name="scale")
    y = b.output([batch, seq, 8], name="y")
    total = b.output([batch], name="total")
    b.aten("aten::mul.Tensor", [x, w], [y])
    b.aten("aten::sum.dim_IntList", [y], [total], dim=[1, 2])
    program = b.build()
    if shared:
        program.share_weight(w, scale)
    return program


def buckets(sizes=(1, 2, 4, 8), dims=(BATCH,)) -> ProgramFamily:
    return ProgramFamily(list(dims), [((n,), scaled(n)) for n in sizes])


def reference(x: torch.Tensor, scale: torch.Tensor = SCALE):
    y = x * scale.to(x.device)
    return y, y.sum(dim=(1, 2))


# ---- without a GPU ----


def test_the_family_validates_and_chooses_members():
    family = buckets()
    family.validate()
    assert family.sizes_of([(3, 4, 8)]) == (3,)
    assert family.select((3,)) == 2 and family.select((8,)) == 3 and family.select((1,)) == 0
    assert "batch 1..8 padded" in repr(family)
    with pytest.raises(InvalidArgumentError, match=r"dim 'batch' is 300, outside 1\.\.8"):
        family.sizes_of([(300, 4, 8)])
    exact = buckets(dims=[dict(BATCH, pad=False)])
    with pytest.raises(InvalidArgumentError, match=r"no member serves batch=3: the members are \(batch=1\)"):
        exact.select((3,))
    with pytest.raises(InvalidArgumentError, match="the family has no members yet"):
        ProgramFamily([BATCH]).sizes_of([(3, 4, 8)])


@pytest.mark.parametrize(
    "dims, members, message",
    [
        ([dict(BATCH, name="")], None, r"dims\[0\]\.name is empty"),
        ([dict(BATCH, min=0)], None, r"dims\[0\]\.min = 0 is outside 1\.\.2147483647"),
        ([dict(BATCH, max=2**31)], None, r"dims\[0\]\.max = 2147483648 is outside"),
        ([dict(BATCH, inputs=[(0, 1)])], None, r"its axis 1 carries dim 'batch', whose size is 1"),
        ([dict(BATCH, outputs=[(2, 0)])], None, r"dims\[0\]\.outputs\[0\] names output 2 but members\[0\]\.program has 2"),
        ([BATCH], [((1,), 1), ((2,), 2), ((2,), 2), ((8,), 8)], r"members\[2\]\.sizes \(batch=2\) are members\[1\]'s too"),
        ([BATCH], [((1,), 1), ((4,), 4)], r"members has none at the maximum \(batch=8\)"),
        ([BATCH], [((1,), 1), ((9,), 9)], r"members\[1\]\.sizes\[0\] = 9 is outside dim 'batch''s range 1\.\.8"),
    ],
)
def test_validation_names_the_field(dims, members, message):
    pairs = [((1,), 1), ((8,), 8)] if members is None else members
    family = ProgramFamily(dims, [(sizes, scaled(n)) for sizes, n in pairs])
    with pytest.raises(InvalidArgumentError, match=message):
        family.validate()


def test_a_dim_given_with_an_unknown_field_is_refused():
    with pytest.raises(InvalidArgumentError, match="unknown dim field 'maximum'"):
        ProgramFamily([dict(BATCH, maximum=8)], [((8,), scaled(8))]).validate()
    with pytest.raises(InvalidArgumentError, match="a family member is a Program, not str"):
        ProgramFamily([BATCH], [((8,), "program")])


def test_the_family_file_round_trips_with_each_weight_once(tmp_path):
    family = buckets()
    data = family.serialize()
    scale_bytes = SCALE.numpy().tobytes()
    assert data.count(scale_bytes) == 1  # four members, one scale
    back = ProgramFamily.deserialize(data)
    assert back.dims == [dict(BATCH, inputs=[(0, 0)], outputs=[(0, 0), (1, 0)])]
    assert [s for s, _ in back.members] == [(1,), (2,), (4,), (8,)]
    assert [p.serialize() for _, p in back.members] == [p.serialize() for _, p in family.members]

    path = tmp_path / "scaled.stitch"
    family.save(path)
    assert [s for s, _ in ProgramFamily.load(path).members] == [(1,), (2,), (4,), (8,)]
    with pytest.raises(InvalidArgumentError, match="is a program family .*stitchcuda.load in Python"):
        Program.load(path)


def test_shared_weights_are_stored_from_their_tensors():
    """A member reading a model's parameter in place (share_weight, no bytes) saves that tensor's values."""
    family = ProgramFamily([BATCH], [((n,), scaled(n, shared=True)) for n in (1, 8)])
    assert not family.members[0][1]._p.has_weight_data(1)
    back = ProgramFamily.deserialize(family.serialize())
    assert back.members[1][1]._p.has_weight_data(1)
    assert back.serialize().count(SCALE.numpy().tobytes()) == 1
    assert not family.members[0][1]._p.has_weight_data(1)  # the bytes were lent for the save only


def test_a_damaged_family_file_is_a_clear_error(tmp_path):
    data = buckets().serialize()
    with pytest.raises(InvalidArgumentError, match=r"remain \(truncated\?\)"):
        ProgramFamily.deserialize(data[:-10])
    flipped = bytearray(data)
    flipped[-5] ^= 0x10
    with pytest.raises(InvalidArgumentError, match="fails its SHA-256 check"):
        ProgramFamily.deserialize(bytes(flipped))
    with pytest.raises(InvalidArgumentError, match="wrong magic bytes"):
        ProgramFamily.deserialize(scaled(1).serialize())
    path = tmp_path / "cut.stitch"
    path.write_bytes(data[:40])
    with pytest.raises(InvalidArgumentError, match="is not a valid program family file: .*fewer than the 52-byte header"):
        ProgramFamily.load(path)
    with pytest.raises(NotFoundError):
        ProgramFamily.load(tmp_path / "missing.stitch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is present")
def test_without_a_gpu_the_executor_says_so(tmp_path):
    path = tmp_path / "scaled.stitch"
    buckets().save(path)
    with pytest.raises(UnavailableError, match="no CUDA device: a family runs on a GPU"):
        stitchcuda.program.load(path)
    with pytest.raises(InvalidArgumentError, match="members has none at the maximum"):
        FamilyExecutor(buckets(sizes=(1, 2)))  # the family is checked before the GPU is looked for


# ---- on a GPU ----

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_every_size_in_range_runs_right(graphs):
    ex = FamilyExecutor(buckets(), graphs=graphs)
    for n in range(1, 9):
        x = torch.randn(n, 4, 8, device="cuda")
        y, total = ex.run([x])
        y_ref, total_ref = reference(x)
        assert y.shape == (n, 4, 8) and total.shape == (n,)
        assert y.is_contiguous() and total.is_contiguous()
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(total, total_ref)
    stats = ex.stats()
    assert stats["runs"] == 8 and stats["padded_runs"] == 4  # 3, 5, 6, 7
    assert [m["calls"] for m in stats["members"]] == [1, 1, 2, 4]
    assert stats["weight_bytes"] == 32  # one scale for four members


@gpu
def test_outputs_are_the_callers_and_bad_calls_name_the_problem():
    ex = FamilyExecutor(buckets())
    x3 = torch.randn(3, 4, 8, device="cuda")
    first, _ = ex.run([x3])
    kept = first.clone()
    ex.run([torch.randn(3, 4, 8, device="cuda")])
    ex.run([torch.randn(4, 4, 8, device="cuda")])
    torch.testing.assert_close(first, kept, rtol=0, atol=0)  # later runs wrote elsewhere
    with pytest.raises(InvalidArgumentError, match=r"dim 'batch' is 9, outside 1\.\.8"):
        ex.run([torch.randn(9, 4, 8, device="cuda")])
    with pytest.raises(InvalidArgumentError, match="input 0 axis 1 is 5 but the family's programs take 4"):
        ex.run([torch.randn(3, 5, 8, device="cuda")])
    with pytest.raises(InvalidArgumentError, match="convert it first"):
        ex.run([torch.randn(3, 4, 8, device="cuda", dtype=torch.float64)])


@gpu
def test_concurrent_calls_on_their_own_streams():
    ex = FamilyExecutor(buckets())
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            stream = torch.cuda.Stream()
            gen = torch.Generator(device="cuda").manual_seed(seed)
            with torch.cuda.stream(stream):
                for i in range(20):
                    n = 1 + (seed + i) % 8
                    x = torch.randn(n, 4, 8, device="cuda", generator=gen)
                    y, total = ex.run([x], stream=stream)
                    stream.synchronize()
                    torch.testing.assert_close(y, reference(x)[0])
                    torch.testing.assert_close(total, reference(x)[1])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert ex.stats()["runs"] == 80


@gpu
def test_add_member_serves_a_size_met_later():
    family = buckets(sizes=(1, 8), dims=[dict(BATCH, pad=False)])
    ex = FamilyExecutor(family)
    x = torch.randn(3, 4, 8, device="cuda")
    with pytest.raises(InvalidArgumentError, match="no member serves batch=3"):
        ex.run([x])
    other = torch.linspace(1.0, 2.0, 8)
    ex.add_member((3,), scaled(3, scale=other))
    torch.testing.assert_close(ex.run([x])[0], reference(x, other)[0])
    assert ex.member_sizes == [[1], [8], [3]] and len(family.members) == 3
    assert ex.stats()["weight_bytes"] == 64  # the new member's scale differs: uploaded for it
    with pytest.raises(InvalidArgumentError, match=r"members\[3\]\.sizes \(batch=3\) are members\[2\]'s too"):
        ex.add_member((3,), scaled(3))


@gpu
def test_at_most_max_resident_members_hold_working_memory():
    ex = FamilyExecutor(buckets(dims=[dict(BATCH, pad=False)]), graphs=True, max_resident=2)
    for n in (1, 2, 4, 8, 1):
        x = torch.randn(n, 4, 8, device="cuda")
        torch.testing.assert_close(ex.run([x])[0], reference(x)[0])
    stats = ex.stats()
    assert stats["resident"] == 2 and stats["releases"] == 3
    assert [m["resident"] for m in stats["members"]] == [True, False, False, True]
    assert stats["members"][1]["executor"]["instances"] == 0  # released: no arena, graph or static buffers
    ex.release()
    assert ex.stats()["resident"] == 0


@gpu
def test_load_returns_a_module_for_a_family_file(tmp_path):
    path = tmp_path / "scaled.stitch"
    ProgramFamily([BATCH], [((n,), scaled(n, shared=True)) for n in (2, 8)]).save(path)
    module = stitchcuda.program.load(path)
    assert isinstance(module, FamilyModule)
    x = torch.randn(5, 4, 8, device="cuda")
    y, total = module(x)
    torch.testing.assert_close(y, reference(x)[0])
    torch.testing.assert_close(total, reference(x)[1])
    assert module.stats()["padded_runs"] == 1
