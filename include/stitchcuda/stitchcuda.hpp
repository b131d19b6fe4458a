// Umbrella header: everything a C++ program needs from StitchCUDA.
#pragma once

#include <stitchcuda/agents.hpp>
#include <stitchcuda/error.hpp>
#include <stitchcuda/family.hpp>
#include <stitchcuda/jit.hpp>
#include <stitchcuda/llm.hpp>
#include <stitchcuda/program.hpp>
#include <stitchcuda/profile.hpp>
#include <stitchcuda/rubric.hpp>
#include <stitchcuda/secrets.hpp>
