// The job event a trainer's parity line becomes ({"event": "parity"}, worker/engine/
// parity_canary.h): rank 0's verdict as one line of text the worker sends as a RankNote, which the
// coordinator adds to the job's events (`spindle status` shows them). Every rank of a gang reaches
// the same verdict, so the other ranks' lines only feed their metrics. Pure function.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "worker/trainer_event.h"

namespace spindle {

// The note for `event` (kind kParity) of rank `rank`; nullopt for ranks other than 0 and for
// other events. E.g. "parity: passed before step 1: cp=2 dp=1 ep=1 lightning=allgather
// mla=all2all computes what cp=1 ep=1 on one rank computes (max relative gradient error 3.1e-07,
// 0.0003 of its bound)".
std::optional<std::string> ParityNoteText(const TrainerEvent& event, int64_t rank);

}  // namespace spindle
