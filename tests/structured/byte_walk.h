// Byte-level random walks for the structured-output tests: from a matcher,
// each step draws one of the bytes it takes, so that a walk explores what
// the grammar allows and finds any dead end (a state that takes no byte and
// cannot end), which a constrained model would meet.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "structured/matcher.h"

namespace moe::structured {

struct ByteWalk {
  int max_steps = 64;
  int stop_one_in = 2;        // where the output may end (after a byte), the walk stops with this odds
  std::string_view favoured;  // drawn from 3 times in 4 when the matcher takes some of them
  std::function<void(const Matcher&, int step)> each_step;  // before each step
};

// The walk's bytes, `m` after them; nullopt (and a test failure) at a dead end.
inline std::optional<std::string> byte_walk(Matcher& m, std::mt19937& rng, const ByteWalk& how = {}) {
  std::string text;
  for (int step = 0; step < how.max_steps; ++step) {
    if (step > 0 && m.accepting() && rng() % static_cast<unsigned>(how.stop_one_in) == 0) break;
    if (how.each_step) how.each_step(m, step);
    std::vector<uint8_t> next, liked;
    for (int b = 0; b < 256; ++b) {
      Matcher copy = m;
      const char c = static_cast<char>(b);
      if (!copy.advance(std::string_view(&c, 1))) continue;
      next.push_back(static_cast<uint8_t>(b));
      if (how.favoured.find(c) != std::string_view::npos) liked.push_back(static_cast<uint8_t>(b));
    }
    if (next.empty()) {
      if (m.accepting()) break;
      ADD_FAILURE() << "a dead end after '" << text << "'";
      return std::nullopt;
    }
    const auto& pool = !liked.empty() && rng() % 4 != 0 ? liked : next;
    const char c = static_cast<char>(pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(rng)]);
    if (!m.advance(std::string_view(&c, 1))) {
      ADD_FAILURE() << "a byte the matcher took alone was refused after '" << text << "'";
      return std::nullopt;
    }
    text += c;
  }
  return text;
}

}  // namespace moe::structured
