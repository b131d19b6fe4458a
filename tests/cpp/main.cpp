// Catch2 2.x provides no main(); this translation unit supplies it (built only for Catch2 2).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
