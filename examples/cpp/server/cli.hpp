// The batching server's command line and serving loop, without torch: `server --help`'s flags, the HTTP
// front and batcher in front of the runners it is given, the SIGTERM/SIGINT drain.
#pragma once

#include <string>

#include "runners.hpp"

namespace stitchcuda_server {

/// What runs the batches: runners.hpp's GPU runners in the server, CPU ones in the tests' stand-in.
struct Runners {
  Loaded (*program)(stitchcuda::program::Program, const ServedModel&, int workers);
  Loaded (*family)(stitchcuda::program::ProgramFamily, const ServedModel&, int workers);
  Loaded (*eager)(const std::string& module_path, const ServedModel&, int workers);  ///< for --eager
};

/// The whole server: parses argv (server --help), loads the model, listens, serves until SIGTERM or SIGINT,
/// drains and prints the metrics. Returns the exit code: 0 drained, 1 an error, 2 bad usage.
int serve_main(int argc, char** argv, const Runners& runners);

}  // namespace stitchcuda_server
