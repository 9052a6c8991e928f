// The CUDA transport's destination exchange, at schedule(): every PE exports the allocations
// holding its destination ranges through CUDA IPC, senders map them (or stage through a bounce
// buffer where an allocation cannot be mapped), and the leader of a GPU's PEs takes their copies.
#include "transports/cuda/cuda_transport_impl.hpp"

namespace reshard::cuda {

std::optional<std::vector<GroupPlan>> CudaTransport::exchange_destinations(
    const ExecutionPlan& plan, PreparedRun& prepared, std::vector<CopyDescriptor>& unstage,
    std::vector<std::uintptr_t>& refused, bool first_phase, bool last_attempt) {
  IpcExporter exporter;
  for (std::uintptr_t base : refused) exporter.refuse(base);
  std::vector<WireBatch> batches;
  std::vector<SharedSpan> spans;
  struct Staged {
    std::size_t shared_span;
    const CopySpan* destination;
  };
  std::vector<Staged> staged;
  // Where each staged destination lands first (its place in the bounce buffer): a leader that
  // makes a follower's copies to it must write there too, as the unstage copy moves it after.
  std::unordered_map<const CopySpan*, unsigned char*> staged_at;
  for (const PlannedBatch& batch : plan.receives) {
    batches.push_back({batch.peer, batch.span_count});
    for (std::uint32_t s = 0; s < batch.span_count; ++s) {
      const CopySpan& span = plan.spans[batch.first_span + s];
      const auto exported = exporter.export_pointer(span.data);
      if (exported) {
        spans.push_back({exported->handle, 0, exported->offset, span.bytes});
      } else {
        prepared.bounce_bytes = (prepared.bounce_bytes + 255) / 256 * 256;
        spans.push_back({kBounceHandle, 0, prepared.bounce_bytes, span.bytes});
        staged.push_back({spans.size() - 1, &span});
        prepared.bounce_bytes += span.bytes;
      }
    }
  }
  if (!staged.empty()) {
    RESHARD_CUDA_CHECK(
        cudaMalloc(&prepared.bounce, std::max<std::uint64_t>(prepared.bounce_bytes, 2 << 20)));
    const auto bounce = exporter.export_pointer(prepared.bounce);
    if (!bounce)
      throw_error(ErrorCode::kSystem, "cannot export the CUDA transport's bounce buffer");
    for (const Staged& s : staged) {
      SharedSpan& span = spans[s.shared_span];
      span.handle = bounce->handle;
      span.offset += bounce->offset;
      unsigned char* landing =
          static_cast<unsigned char*>(prepared.bounce) + (span.offset - bounce->offset);
      unstage.push_back(
          {landing, reinterpret_cast<unsigned char*>(s.destination->data), span.bytes, 0});
      staged_at.emplace(s.destination, landing);
    }
    RESHARD_LOG(kInfo, staged.size()
                           << " destination range(s), " << format_bytes(prepared.bounce_bytes)
                           << ", cannot be shared through CUDA IPC (stream-ordered or "
                              "virtual-memory allocations): staging them through a "
                              "bounce buffer");
  }

  // Delegation (see SameDeviceOrder): a follower hands its GPU's leader its sends to the PEs its
  // stream orders (on this GPU, or on another where a GPU is shared) and its local copies, as
  // (allocation, offset) of its own memory; the leader maps them. A follower left with no other
  // peer runs no kernel, so its GPU runs one process's kernel a run and is never handed over.
  // A follower whose memory cannot all be exported (or mapped, by the retry) keeps the whole
  // group to pairwise order for this phase.
  const bool follower = delegate_ && leader_ != me_;
  std::uint8_t delegable = follower ? 1 : 0;
  std::uint8_t kernel_ordered_work = 0;
  for (const auto* batches_of : {&plan.sends, &plan.receives})
    for (const PlannedBatch& batch : *batches_of)
      if (!stream_ordered_[batch.peer]) kernel_ordered_work = 1;
  std::vector<WireBatch> delegated_batches;
  std::vector<SharedSpan> delegated_spans, local_sources, local_destinations;
  auto export_span = [&](const void* pointer, std::uint64_t bytes, std::vector<SharedSpan>& into) {
    const auto exported = delegable ? exporter.export_pointer(pointer) : std::nullopt;
    if (!exported) {
      delegable = 0;
      return;
    }
    into.push_back({exported->handle, 0, exported->offset, bytes});
  };
  if (follower) {
    for (const PlannedBatch& batch : plan.sends) {
      if (!stream_ordered_[batch.peer]) continue;
      delegated_batches.push_back({batch.peer, batch.span_count});
      for (std::uint32_t s = 0; s < batch.span_count; ++s) {
        const CopySpan& span = plan.spans[batch.first_span + s];
        export_span(span.data, span.bytes, delegated_spans);
      }
    }
    for (const LocalCopy& copy : plan.local_copies) {
      export_span(copy.src, copy.bytes, local_sources);
      export_span(copy.dst, copy.bytes, local_destinations);
    }
    if (!delegable) {
      delegated_batches.clear();
      delegated_spans.clear();
      local_sources.clear();
      local_destinations.clear();
    }
  }

  message::Writer mine;
  mine.put_array(std::span<const HandleBytes>(exporter.handles()));
  mine.put_array(std::span<const WireBatch>(batches));
  mine.put_array(std::span<const SharedSpan>(spans));
  mine.put<std::uint8_t>(delegable);
  mine.put<std::uint8_t>(kernel_ordered_work);
  mine.put_array(std::span<const WireBatch>(delegated_batches));
  mine.put_array(std::span<const SharedSpan>(delegated_spans));
  mine.put_array(std::span<const SharedSpan>(local_sources));
  mine.put_array(std::span<const SharedSpan>(local_destinations));
  const auto all = bootstrap_.all_gather(mine.bytes());

  // My sends to each peer, in plan order, meet that peer's receives from me in its plan order.
  std::vector<std::vector<const PlannedBatch*>> sends_to(n_pes_);
  for (const PlannedBatch& batch : plan.sends) sends_to[batch.peer].push_back(&batch);

  struct PeerExports {
    std::vector<HandleBytes> handles;
    std::vector<WireBatch> batches;
    std::vector<SharedSpan> spans;
    bool delegable = false;
    bool kernel_ordered_work = false;
    std::vector<WireBatch> delegated_batches;
    std::vector<SharedSpan> delegated_spans, local_sources, local_destinations;
  };
  std::vector<PeerExports> exports(n_pes_);
  for (int pe = 0; pe < n_pes_; ++pe) {
    message::Reader reader(all[pe]);
    PeerExports& e = exports[pe];
    e.handles = reader.get_array<HandleBytes>();
    e.batches = reader.get_array<WireBatch>();
    e.spans = reader.get_array<SharedSpan>();
    e.delegable = reader.get<std::uint8_t>() != 0;
    e.kernel_ordered_work = reader.get<std::uint8_t>() != 0;
    e.delegated_batches = reader.get_array<WireBatch>();
    e.delegated_spans = reader.get_array<SharedSpan>();
    e.local_sources = reader.get_array<SharedSpan>();
    e.local_destinations = reader.get_array<SharedSpan>();
  }
  bool delegated = delegate_;
  for (int pe : followers_) delegated = delegated && exports[pe].delegable;
  const bool leads = delegated && leader_ == me_;
  // What this PE copies itself: a follower leaves its sends to its GPU's PEs to the leader.
  auto copies_to = [&](int pe) {
    return pe != me_ && !sends_to[pe].empty() && !(delegated && follower && stream_ordered_[pe]);
  };

  // The batches `receiver` expects from `sender`, in its plan order (which meets the sender's
  // plan order of its sends to it): where each one's spans start, in the receiver's exported
  // spans (in `plan.spans` for this PE's own receives), and how many there are.
  struct BatchSpans {
    std::size_t first;
    std::uint32_t count;
  };
  auto receives_from = [&](int receiver, int sender) {
    std::vector<BatchSpans> found;
    if (receiver == me_) {
      for (const PlannedBatch& batch : plan.receives)
        if (batch.peer == sender) found.push_back({batch.first_span, batch.span_count});
      return found;
    }
    std::size_t first = 0;
    for (const WireBatch& batch : exports[receiver].batches) {
      if (batch.peer == sender) found.push_back({first, batch.span_count});
      first += batch.span_count;
    }
    return found;
  };

  std::set<IpcImports::Key> needed;
  auto need_handle = [&](int owner, std::uint32_t handle) {
    if (handle < exports[owner].handles.size())
      needed.insert({owner, exports[owner].handles[handle]});
  };
  // `receiver`'s destinations of its batches from `sender`.
  auto need_destinations = [&](int receiver, int sender) {
    for (const BatchSpans& batch : receives_from(receiver, sender))
      for (std::uint32_t s = 0; s < batch.count; ++s)
        need_handle(receiver, exports[receiver].spans.at(batch.first + s).handle);
  };
  for (int pe = 0; pe < n_pes_; ++pe)
    if (copies_to(pe)) need_destinations(pe, me_);
  if (leads) {
    for (int f : followers_) {
      const PeerExports& from = exports[f];
      for (const auto* list :
           {&from.delegated_spans, &from.local_sources, &from.local_destinations})
        for (const SharedSpan& span : *list) need_handle(f, span.handle);
      std::set<int> destinations;
      for (const WireBatch& batch : from.delegated_batches)
        if (batch.peer != me_) destinations.insert(batch.peer);
      for (int pe : destinations) need_destinations(pe, f);
    }
  }
  // Mappings this schedule does not use are closed before any new one opens: a peer that freed a
  // buffer and allocated another on the same driver page can be mapped only once the old mapping
  // is gone (the bench's alternating buffers were staged through the bounce buffer before).
  // Later phases keep what earlier phases of the schedule mapped.
  if (first_phase) imports_.retain(needed);
  std::vector<GroupPlan> groups;
  std::vector<PeerHandle> unmappable;  // (owner PE, handle index)
  // Base address of `owner`'s allocation `handle` here; null (and noted) where it cannot be
  // mapped on this attempt.
  auto map_handle = [&](int owner, std::uint32_t handle) -> unsigned char* {
    const auto& handles = exports[owner].handles;
    if (handle >= handles.size())
      throw_error(ErrorCode::kSystem, "internal: PE " + std::to_string(owner) +
                                          " named an allocation it did not export");
    unsigned char* base = imports_.map(owner, handles[handle], !last_attempt);
    if (base == nullptr) unmappable.push_back({owner, handle});
    return base;
  };
  for (int pe = 0; pe < n_pes_; ++pe) {
    if (!copies_to(pe)) continue;
    const auto& peer_spans = exports[pe].spans;
    const std::vector<BatchSpans> receives = receives_from(pe, me_);
    if (receives.size() > sends_to[pe].size()) {
      throw_error(ErrorCode::kSystem, "internal: PE " + std::to_string(pe) +
                                          " expects more batches from PE " + std::to_string(me_) +
                                          " than it plans to send");
    }
    GroupPlan group;
    group.group.peer = pe;
    // The rows of a strided destination share their allocation: look it up once for them all.
    std::uint32_t mapped_handle = UINT32_MAX;
    unsigned char* mapped_base = nullptr;
    for (std::size_t b = 0; b < receives.size(); ++b) {
      const PlannedBatch& send = *sends_to[pe][b];
      if (send.span_count != receives[b].count) {
        throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(me_) + " and " +
                                            std::to_string(pe) + " split a batch differently");
      }
      for (std::uint32_t s = 0; s < send.span_count; ++s) {
        const CopySpan& source = plan.spans[send.first_span + s];
        const SharedSpan& target = peer_spans.at(receives[b].first + s);
        if (target.bytes != source.bytes) {
          throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(me_) + " and " +
                                              std::to_string(pe) + " disagree on a span");
        }
        if (target.handle != mapped_handle) {
          mapped_base = map_handle(pe, target.handle);
          mapped_handle = target.handle;
        }
        if (mapped_base == nullptr) continue;
        group.add(reinterpret_cast<const unsigned char*>(source.data), mapped_base + target.offset,
                  source.bytes);
      }
    }
    groups.push_back(std::move(group));
  }
  // The leader makes follower f's copies: f's sends to each PE of this GPU, in f's plan order,
  // meet that PE's receives from f in its plan order (as a sender's own do); then its local ones.
  auto add_delegated_copies = [&](int f) {
    const PeerExports& from = exports[f];
    std::map<int, GroupPlan> by_destination;
    std::map<int, std::vector<BatchSpans>> receives;  // per destination, from f
    std::map<int, std::size_t> next_receive;
    std::size_t source_index = 0;
    for (const WireBatch& send : from.delegated_batches) {
      const int to = send.peer;
      GroupPlan& group = by_destination[to];
      group.group.peer = to;
      group.delegated = true;
      const auto& expected = receives.try_emplace(to, receives_from(to, f)).first->second;
      const std::size_t b = next_receive[to]++;
      if (b >= expected.size() || expected[b].count != send.span_count) {
        throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(f) + " and " +
                                            std::to_string(to) + " split a batch differently");
      }
      const std::size_t first = expected[b].first;
      const std::uint32_t count = expected[b].count;
      for (std::uint32_t s = 0; s < count; ++s) {
        const SharedSpan& source = from.delegated_spans.at(source_index + s);
        unsigned char* source_base = map_handle(f, source.handle);
        unsigned char* destination = nullptr;
        std::uint64_t bytes = 0;
        if (to == me_) {
          // This PE's own destination, or its bounce buffer where it is staged (else the unstage
          // copy after the run would overwrite what lands here).
          const CopySpan& target = plan.spans.at(first + s);
          const auto landing = staged_at.find(&target);
          destination = landing != staged_at.end() ? landing->second
                                                   : reinterpret_cast<unsigned char*>(target.data);
          bytes = target.bytes;
        } else {
          const SharedSpan& target = exports[to].spans.at(first + s);
          unsigned char* base = map_handle(to, target.handle);
          destination = base == nullptr ? nullptr : base + target.offset;
          bytes = target.bytes;
        }
        if (bytes != source.bytes) {
          throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(f) + " and " +
                                              std::to_string(to) + " disagree on a span");
        }
        if (source_base != nullptr && destination != nullptr)
          group.add(source_base + source.offset, destination, bytes);
      }
      source_index += count;
    }
    for (auto& entry : by_destination) groups.push_back(std::move(entry.second));
    GroupPlan local;
    local.group.peer = f;
    local.delegated = true;
    for (std::size_t i = 0; i < from.local_sources.size(); ++i) {
      const SharedSpan& source = from.local_sources[i];
      const SharedSpan& target = from.local_destinations.at(i);
      unsigned char* source_base = map_handle(f, source.handle);
      unsigned char* target_base = map_handle(f, target.handle);
      if (source_base != nullptr && target_base != nullptr)
        local.add(source_base + source.offset, target_base + target.offset, source.bytes);
    }
    if (local.group.bytes > 0) groups.push_back(std::move(local));
  };
  std::vector<std::uint64_t*> idle_followers;
  if (leads) {
    for (int f : followers_) {
      add_delegated_copies(f);
      if (!exports[f].kernel_ordered_work)
        idle_followers.push_back(SignalLayout::run_count(peer_signals_[f], n_pes_));
    }
  }
  prepared.delegated = delegated;
  prepared.local_copies_delegated = delegated && follower;
  prepared.kernel_idle = delegated && follower && kernel_ordered_work == 0;
  prepared.follower_run_count = static_cast<std::uint32_t>(idle_followers.size());
  prepared.follower_runs.upload(idle_followers);
  // Every PE learns which of its allocations a peer could not map, and all retry together.
  message::Writer failures;
  failures.put_array(std::span<const PeerHandle>(unmappable));
  bool any = false;
  for (const auto& part : bootstrap_.all_gather(failures.bytes())) {
    message::Reader reader(part);
    for (const PeerHandle& failed : reader.get_array<PeerHandle>()) {
      any = true;
      if (failed.owner == me_) refused.push_back(exporter.base_of(failed.handle));
    }
  }
  if (any) return std::nullopt;
  return groups;
}

}  // namespace reshard::cuda
