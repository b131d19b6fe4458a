#include <stitchcuda/agents.hpp>
