// A refit an inference engine can serve through: stage the bytes, then commit them at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "reshard/resharder.hpp"

namespace reshard {

// A bound refit (see Refit) whose transfers land in memory the refit owns on each destination
// PE (a twin of every destination tensor) instead of in the destination tensors. stage() moves
// every byte while the engine keeps reading its old weights; commit() then copies the staged
// bytes into the destination tensors on this PE alone (the blocks the plan writes, in one
// batched device copy at memory speed, or memcpys on the host) and advances the weight version.
// A failure before commit() (a dead peer, a timeout, a refusal) leaves every destination tensor
// as it was, and the error says so. The twins cost as much memory as this PE's destination
// tensors: `max_staged_bytes` refuses a refit that needs more (on every PE, saying how much it
// needs) before anything is allocated. With groups (ReshardOptions::param_groups) a part can be
// staged and committed on its own: stage(groups) then commit(groups), a layer at a time, say,
// each group's parameters switching at their commit.
class StagedRefit {
 public:
  // Collective, as Refit's constructor.
  StagedRefit(std::shared_ptr<const ReshardPlan> plan, TensorMap src, TensorMap dst,
              CopyService& service, std::shared_ptr<ReshardTransform> transform = nullptr,
              const ReshardOptions& options = {}, void* cuda_stream = nullptr,
              std::optional<std::uint64_t> max_staged_bytes = std::nullopt);
  ~StagedRefit();
  StagedRefit(StagedRefit&&) noexcept;
  StagedRefit& operator=(StagedRefit&&) noexcept;
  StagedRefit(const StagedRefit&) = delete;
  StagedRefit& operator=(const StagedRefit&) = delete;

  // Collective (as Refit::run): moves every bound source slice into the destination PEs'
  // staging. With a CUDA stream the work is queued there; otherwise it returns when the bytes
  // have landed. A stage() replaces what an earlier one staged.
  ReshardReport stage(void* cuda_stream = nullptr);
  // Collective: stage() of only the given groups (as Refit::run(groups)); what other groups
  // staged stays staged.
  ReshardReport stage(std::span<const std::uint32_t> groups, void* cuda_stream = nullptr);
  // This PE alone, no collective: writes what the last stage() staged into this PE's
  // destination tensors and advances version(). With a CUDA stream it is queued there (after a
  // stage() queued on the same stream; capturable); otherwise it returns when the tensors hold
  // the new values. Refused where nothing is staged (no stage() since the last commit(), or the
  // last stage() failed). A PE with no destination tensors only advances its version.
  void commit(void* cuda_stream = nullptr);
  // This PE alone: commit() of only the given groups, each of which must be staged (by a
  // stage() or a stage(groups) since its last commit); their parameters' destinations take the
  // staged values, the other destinations keep theirs, and version() advances.
  void commit(std::span<const std::uint32_t> groups, void* cuda_stream = nullptr);
  // Collective, as Refit::update; what was staged is dropped.
  ReshardReport update(const TensorMap& src, const TensorMap& dst, void* cuda_stream = nullptr);

  // Commits so far on this PE: the weight version its destination tensors hold.
  std::uint64_t version() const;
  // Whether every group is staged: a stage() succeeded since the last commit().
  bool staged() const;
  // The groups staged since their last commit, in group order.
  std::vector<std::uint32_t> staged_groups() const;
  // The staging memory this PE holds for its destination tensors.
  std::uint64_t staged_bytes() const;
  const ReshardReport& report() const;
  const TensorMap& sources() const;
  const TensorMap& destinations() const;
  CopyService& service() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace reshard
