// Memory the executor and the transforms own (staging for non-contiguous slices, wire buffers of
// conversions) and the copies between a tensor's block and a dense buffer, on the host or on the
// tensor's GPU.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "execution/box_view.hpp"
#include "reshard/types.hpp"

namespace reshard::execution {

// Owned memory of the same kind and device as some tensor; freed on destruction.
class Staging {
 public:
  Staging() = default;
  Staging(MemoryKind kind, int device, std::size_t bytes);
  ~Staging();
  Staging(Staging&& other) noexcept;
  Staging& operator=(Staging&& other) noexcept;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  const Buffer& buffer() const { return buffer_; }
  std::byte* data() const { return static_cast<std::byte*>(buffer_.data); }

 private:
  void release();
  Buffer buffer_;
};

// Buffers the executor and the transforms keep per op and side, carved from a few large
// allocations: a refit's wire buffers then cost one CUDA IPC export per allocation instead of one
// per op (small separate cudaMallocs also share driver pages, which IPC cannot map twice), and
// every refit gets the same buffer back for the same key, so the schedule is reused.
//
// A refit bounded by a staging budget sizes first (start_sizing: slot() hands out no memory and
// records what each key asks for), then arrange() gives every sized key its place in one arena
// per memory place, the keys of one phase side by side and every phase from the start of its
// region: phases run one after the other and reuse the same memory. With two regions, phase p
// takes region p % 2, so a phase's staging is still read (its unpacks and conversions on arrival)
// while the next phase's bytes land beside it.
class StagingPool {
 public:
  using Key = std::tuple<bool, TaskId, int>;  // (sending, op task id, buffer index)
  using OpKey = std::pair<bool, TaskId>;      // (sending, op task id)

  // The buffer for `key`, of `bytes` in the same place as `like` (kind and device): its place in
  // the arena where arrange() gave it one that fits, else the one returned last time when it
  // still fits, else carved from the pool. Space a key outgrows is reclaimed only with the pool.
  // While sizing: a buffer at an address that is no memory (each slot its own, so callers can
  // tell slots apart; sized_owner() says whose it is); the bytes are only recorded.
  const Buffer& slot(const Key& key, const Buffer& like, std::size_t bytes);

  // Forgets every slot and starts recording what slot() is asked for.
  void start_sizing();
  bool sizing() const { return sizing_; }
  // While sizing: the bytes (each slot rounded up to the pool's alignment) asked for per
  // (sending, op task id) since start_sizing().
  const std::map<OpKey, std::size_t>& sized_bytes() const { return sized_by_op_; }
  // While sizing: the key whose slot a buffer slot() returned starts at, if `data` is one.
  std::optional<Key> sized_owner(const void* data) const;
  // Ends sizing: places every sized key in its phase (`phase_of` by (sending, op task id)), the
  // phases in `regions` (1 or 2) regions one after the other. Returns the bytes of the largest
  // phase of each region, summed over regions and memory places: what the refit holds.
  std::size_t arrange(const std::function<std::uint32_t(const OpKey&)>& phase_of,
                      std::uint32_t regions = 1);

  std::size_t reserved_bytes() const;

 private:
  struct Chunk {
    Staging memory;
    std::size_t used = 0;
  };
  struct Slot {
    Buffer buffer;
    std::size_t capacity = 0;
  };
  struct Sized {
    Key key;
    Buffer like;  // its place (kind and device)
    std::size_t bytes;
  };
  std::byte* carve(const Buffer& like, std::size_t bytes);
  // The arena of `like`'s place, of at least `bytes` (kept while large enough).
  Staging& arena(const Buffer& like, std::size_t bytes);

  // Hashed: a refit of a MoE model looks up tens of thousands of keys, twice per op.
  struct KeyHash {
    std::size_t operator()(const Key& key) const;
  };

  std::vector<Chunk> chunks_;
  std::vector<Staging> arenas_;  // one per memory place
  std::unordered_map<Key, Slot, KeyHash> slots_;
  bool sizing_ = false;
  std::vector<Sized> sized_;  // in the order slot() was asked
  std::map<OpKey, std::size_t> sized_by_op_;
  std::unordered_map<std::uintptr_t, Key> sized_owners_;  // by the address slot() made up
  std::uintptr_t sized_end_ = 0;
  Buffer sized_buffer_;
};

// One block copy between row views (`element_bytes` per element; the views' rows and columns
// agree). Plain data, so kernels take it by value or from device memory.
struct BlockCopy {
  const std::byte* src = nullptr;
  BoxView src_view;
  std::byte* dst = nullptr;
  BoxView dst_view;
  std::uint32_t element_bytes = 1;
  std::uint32_t zero = 0;  // where padding would be: job lists are compared byte for byte
  // even_row_stride of the views (0: rows not evenly spaced), so kernels find rows by a multiply.
  std::int64_t src_stride = 0, dst_stride = 0;
};

// Block copies listed once and replayed at every refit: on the GPU one kernel launch runs all of
// them (the list is uploaded at the first run after a change), on the host a loop of memcpys.
class BlockCopyBatch {
 public:
  BlockCopyBatch() = default;
  ~BlockCopyBatch();
  BlockCopyBatch(const BlockCopyBatch&) = delete;
  BlockCopyBatch& operator=(const BlockCopyBatch&) = delete;

  // The block `view` of `tensor` into the dense buffer `out`, and back.
  void add_pack(const Buffer& tensor, const BoxView& view, std::size_t element_bytes,
                const Buffer& out);
  void add_unpack(const Buffer& in, const Buffer& tensor, const BoxView& view,
                  std::size_t element_bytes);
  // The block `view` of `from` into the same block of `to` (two tensors of one layout).
  void add_copy(const Buffer& from, const Buffer& to, const BoxView& view,
                std::size_t element_bytes);
  void clear();
  bool empty() const { return copies_.empty(); }
  std::size_t size() const { return copies_.size(); }
  void run(void* stream);

 private:
  void add(const Buffer& src, const BoxView& src_view, const Buffer& dst, const BoxView& dst_view,
           std::size_t element_bytes);

  std::vector<BlockCopy> copies_;
  MemoryKind kind_ = MemoryKind::kHost;
  int device_ = -1;
  void* upload_ = nullptr;  // cuda::CopyUpload: the list in device memory
  bool uploaded_ = false;   // the device list is copies_ as they are now
};

#ifdef RESHARD_WITH_CUDA
namespace cuda {
void* allocate(int device, std::size_t bytes);
void release(int device, void* pointer);
// A list of block copies in device memory, replaced by a copy queued on the stream.
void* create_copy_upload();
void destroy_copy_upload(void* upload);
// Runs `copies` in one launch; uploads them first unless `uploaded` (the list is unchanged).
void run_block_copies(const std::vector<BlockCopy>& copies, bool uploaded, void* upload,
                      void* stream);
// A non-blocking stream on `device`; with `high_priority`, of the device's greatest priority.
void* create_stream(int device, bool high_priority = false);
void destroy_stream(int device, void* stream);
void synchronize_stream(void* stream);
// Loads the executor's kernels (block copies, conversions) on `device` now, before any refit
// queues work behind a peer's wait (see reshard::cuda::load_copy_kernels).
void load_kernels(int device);
// `own` (from create_stream) waits for the work queued on the legacy default stream so far: what a
// caller that gives no stream has queued its tensors' writes on.
void wait_for_default_stream(int device, void* own);
void* create_event(int device);
void destroy_event(int device, void* event);
// Work queued on `later` from now on waits for the work queued on `earlier` so far (`event`
// records the point).
void order_after(void* later, void* earlier, void* event);
// The two halves of order_after, for a wait queued later than the point it waits for.
void record_event(void* event, void* stream);
void wait_event(void* stream, void* event);
}  // namespace cuda
#endif

}  // namespace reshard::execution
