"""Writes the LibTorch-eager twin's module for `server --eager`: the model of a KernelBench-format file
(Model, get_inputs, get_init_inputs), built as `stitchcuda optimize FILE --save X.stitch` builds it (the
same seed, so the same weights), traced on its example inputs and saved as TorchScript.

    python examples/cpp/server/export_eager.py examples/models/block.py build/block.pt
"""
import sys

import torch

from stitchcuda.verify.cli import load_problem


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    task = load_problem(argv[0])
    model = task.build_reference(0).eval()  # optimize's seed: the artifact holds these weights
    inputs = task.make_inputs(0)
    # Traced where it will run, so no device is baked into the graph as the CPU; a CPU trace (no GPU
    # here) still loads onto the GPU, its parameters moved by `server --eager`.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    with torch.no_grad():
        traced = torch.jit.trace(model, inputs)
    torch.jit.save(traced, argv[1])
    shapes = ", ".join(str(list(x.shape)) for x in inputs if isinstance(x, torch.Tensor))
    print(f"saved {argv[1]} (traced on {device}, inputs {shapes})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
