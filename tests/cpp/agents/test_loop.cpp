#include "catch_shim.hpp"
