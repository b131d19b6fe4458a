// server: an HTTP inference server that batches. Loads a .stitch artifact whose inputs and outputs carry
// the batch as dim 0 — one program (its batch size) or a program family (every batch up to its max) —,
// gathers concurrent POST /v1/infer requests into batches of up to that size within a latency window, runs
// each batch once on its own CUDA stream and answers every request. SIGTERM or SIGINT stops taking
// connections, answers what was accepted, prints the metrics and exits 0.
//
//   server MODEL.stitch [--port N] [--max-wait-us N] ...        (server --help says more)
#include "cli.hpp"
#include "runners.hpp"

using namespace stitchcuda_server;

int main(int argc, char** argv) { return serve_main(argc, argv, {program_runner, family_runner, eager_runner}); }
