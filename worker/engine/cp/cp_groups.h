// CpGroups: the 2-D split of a CP group for the "hybrid" modes (DESIGN.md section 3;
// parallel.ulysses = u, cp = u x r), the one place that maps a CP rank to its Ulysses group and
// its place on the ring.
//
// CP rank g is member g % u of Ulysses group g / u: a group is u consecutive CP ranks (placed side
// by side, where the all-to-all's traffic is cheapest). Group j holds its ranks' zigzag chunks,
// which are exactly chunks j and 2r-1-j of the sequence cut into 2r super-chunks of u chunks each:
// the level across the groups (MLA's Ring, Lightning's state AllGather) is the ordinary zigzag
// over r ranks, one a group (ShardForCp(full, r, j)). Member i of every group computes heads
// [i H/u, (i+1) H/u) after the Ulysses exchange, so the i-th members of the r groups form ring i,
// in which CP rank g has rank Group(g). Pure ring and All2All are the cases u = 1 and u = cp.
// Plain data; no thread-safety concerns.
#pragma once

#include <cstdint>

namespace spindle {

struct CpGroups {
  int64_t cp = 1;
  int64_t u = 1;  // ranks a Ulysses group
  int64_t r() const { return cp / u; }
  int64_t Member(int64_t rank) const { return rank % u; }  // its rank in its Ulysses group
  int64_t Group(int64_t rank) const { return rank / u; }   // its rank in its ring
  int64_t Rank(int64_t group, int64_t member) const { return group * u + member; }
};

}  // namespace spindle
