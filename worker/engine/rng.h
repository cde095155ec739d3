// Counter-based random numbers (SplitMix64 over (seed, stream, counter)): every draw is a pure
// function of its coordinates, so data and initialisation are reproducible from the seed alone
// and resuming needs no hidden generator state. Thread-safe (stateless helpers + value types).
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace spindle {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t HashCombine(uint64_t a, uint64_t b) { return SplitMix64(a ^ SplitMix64(b)); }

// FNV-1a: a stable hash of a name (std::hash may differ between standard libraries).
inline uint64_t HashName(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// A small sequential generator for one stream; its whole state is (key, counter).
class Rng {
 public:
  explicit Rng(uint64_t key, uint64_t counter = 0) : key_(key), counter_(counter) {}
  uint64_t Next() { return SplitMix64(key_ ^ SplitMix64(counter_++)); }
  // Uniform in [0, n).
  uint64_t Below(uint64_t n) { return n ? Next() % n : 0; }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Draws exactly two values (counters c and c + 1), so the n-th Normal() of a stream started at
  // counter 0 is Rng(key, 2n).Normal(): streams can be filled in parallel.
  double Normal() {
    double u1 = Uniform(), u2 = Uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  uint64_t counter() const { return counter_; }

 private:
  uint64_t key_;
  uint64_t counter_;
};

}  // namespace spindle
