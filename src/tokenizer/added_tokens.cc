#include "tokenizer/added_tokens.h"

#include <algorithm>

namespace moe::tokenizer {

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  for (uint32_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i].content.empty()) continue;
    by_first_byte_[static_cast<unsigned char>(tokens_[i].content[0])].push_back(i);
  }
  for (auto& list : by_first_byte_) {
    std::stable_sort(list.begin(), list.end(), [&](uint32_t a, uint32_t b) {
      return tokens_[a].content.size() > tokens_[b].content.size();
    });
  }
}

void AddedTokenMatcher::split(std::string_view text, bool match_special, std::vector<Segment>& out) const {
  size_t segment_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[pos])];
    const AddedToken* found = nullptr;
    for (uint32_t index : candidates) {
      const AddedToken& token = tokens_[index];
      if (!match_special && token.special) continue;
      if (text.compare(pos, token.content.size(), token.content) == 0) {
        found = &token;
        break;
      }
    }
    if (found == nullptr) {
      ++pos;
      continue;
    }
    if (pos > segment_start) out.push_back(Segment{text.substr(segment_start, pos - segment_start), -1});
    out.push_back(Segment{text.substr(pos, found->content.size()), found->id});
    pos += found->content.size();
    segment_start = pos;
  }
  if (segment_start < text.size()) out.push_back(Segment{text.substr(segment_start), -1});
}

}  // namespace moe::tokenizer
