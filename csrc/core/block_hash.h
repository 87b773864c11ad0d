// Chained 128-bit content hash of full KV blocks for automatic prefix caching.
#pragma once

#include <cstdint>

namespace pagellm {

// Two independent 64-bit lanes: `hash` keys the prefix-cache index, `check` is stored beside the
// cached block and compared on lookup, so a wrong hit needs a 128-bit collision of the whole chain
// (on top of that, lookups also compare the block's token ids, parent hash and extra key).
struct BlockHash {
  uint64_t hash = 0;
  uint64_t check = 0;

  // Lane-wise equality.
  bool operator==(const BlockHash& o) const { return hash == o.hash && check == o.check; }
  // Lane-wise inequality.
  bool operator!=(const BlockHash& o) const { return !(*this == o); }
};

// SplitMix64 finalizer: a strong 64-bit bijective mixer.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

// Rotates left by r bits (0 < r < 64).
inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Hash of one block chained from its parent's hash (the root parent is BlockHash{}), its token ids
// and an extra key (cache salt / LoRA id; 0 = none).
inline BlockHash hash_block_tokens(const BlockHash& parent, const int64_t* tokens, int64_t n,
                                   uint64_t extra_key) {
  uint64_t a = mix64(parent.hash ^ 0x9E3779B97F4A7C15ULL) ^ mix64(extra_key + 0x632BE59BD9B4E019ULL);
  uint64_t b = rotl64(parent.check, 17) ^ (extra_key * 0xFF51AFD7ED558CCDULL) ^ 0xC4CEB9FE1A85EC53ULL;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t t = static_cast<uint64_t>(tokens[i]);
    a = mix64(a + t * 0x9FB21C651E98DF25ULL + static_cast<uint64_t>(i));
    b = (rotl64(b, 31) ^ t) * 0x87C37B91114253D5ULL + 0x52DCE729ULL;
  }
  BlockHash h;
  h.hash = mix64(a ^ static_cast<uint64_t>(n));
  h.check = mix64(b ^ (static_cast<uint64_t>(n) << 32));
  return h;
}

}  // namespace pagellm
