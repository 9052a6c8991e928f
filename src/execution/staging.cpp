#include "execution/staging.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "core/host_copy.hpp"
#include "execution/row_walk.hpp"
#include "reshard/error.hpp"

namespace reshard::execution {
namespace {

// Host loop shared by pack and unpack: rows of the source view to rows of the destination view.
void copy_block_host(const BlockCopy& copy) {
  const std::size_t row_bytes = static_cast<std::size_t>(copy.src_view.cols) * copy.element_bytes;
  for (std::int64_t row = 0; row < copy.src_view.rows; ++row) {
    copy_bytes(copy.dst + copy.dst_view.row_start(row) * copy.element_bytes,
               copy.src + copy.src_view.row_start(row) * copy.element_bytes, row_bytes);
  }
}

// The dense side of a pack or unpack, shaped like the block's rows.
BoxView dense_rows(const BoxView& view) {
  BoxView dense;
  dense.cols = view.cols;
  dense.outer_dims = 1;
  dense.outer_extent[0] = view.rows;
  dense.outer_stride[0] = view.cols;
  dense.rows = view.rows;
  return dense;
}

BlockCopy block_copy(const Buffer& src, const BoxView& src_view, const Buffer& dst,
                     const BoxView& dst_view, std::size_t element_bytes) {
  if (src.kind != dst.kind) {
    throw_error(ErrorCode::kInvalidArgument, "staging copy between host and GPU memory: " +
                                                 describe(src) + " -> " + describe(dst));
  }
  return {static_cast<const std::byte*>(src.data),
          src_view,
          static_cast<std::byte*>(dst.data),
          dst_view,
          static_cast<std::uint32_t>(element_bytes),
          0,
          even_row_stride(src_view),
          even_row_stride(dst_view)};
}

}  // namespace

Staging::Staging(MemoryKind kind, int device, std::size_t bytes) {
  const std::size_t size = bytes == 0 ? 1 : bytes;
  if (kind == MemoryKind::kHost) {
    void* data = std::aligned_alloc(256, (size + 255) / 256 * 256);
    if (data == nullptr) throw std::bad_alloc();
    buffer_ = Buffer::host(data, bytes);
    return;
  }
#ifdef RESHARD_WITH_CUDA
  buffer_ = Buffer::cuda(cuda::allocate(device, size), bytes, device);
#else
  (void)device;
  throw_error(ErrorCode::kUnsupported, "GPU staging needs a build with CUDA");
#endif
}

Staging::~Staging() { release(); }

namespace {

constexpr std::size_t kSlotAlignment = 256;  // keeps every slot on the 16-byte vector path
constexpr std::size_t kFirstChunk = std::size_t{64} << 20;
constexpr std::size_t kLargestChunk = std::size_t{1} << 30;

std::size_t aligned(std::size_t bytes) {
  return (bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
}

// What a slot of `bytes` takes of its memory (an empty one too: each slot has an address of its
// own). Sizing counts it the same way, so the budget holds what arrange() places.
std::size_t slot_bytes(std::size_t bytes) { return aligned(std::max<std::size_t>(bytes, 1)); }

bool same_place(const Buffer& a, const Buffer& b) {
  return a.kind == b.kind && (a.kind == MemoryKind::kHost || a.device == b.device);
}

}  // namespace

std::size_t StagingPool::KeyHash::operator()(const Key& key) const {
  const auto [sending, task, index] = key;
  const std::uint64_t mixed =
      (task * 0x9e3779b97f4a7c15ull) ^ (static_cast<std::uint64_t>(index) << 1) ^ (sending ? 1 : 0);
  return static_cast<std::size_t>(mixed ^ (mixed >> 29));
}

const Buffer& StagingPool::slot(const Key& key, const Buffer& like, std::size_t bytes) {
  if (sizing_) {
    sized_.push_back({key, like, bytes});
    sized_by_op_[{std::get<0>(key), std::get<1>(key)}] += slot_bytes(bytes);
    sized_owners_[sized_end_] = key;
    sized_buffer_ = like;
    sized_buffer_.data = reinterpret_cast<void*>(sized_end_);
    sized_buffer_.bytes = bytes;
    sized_end_ += slot_bytes(bytes);
    return sized_buffer_;
  }
  Slot& slot = slots_[key];
  if (slot.buffer.data == nullptr || slot.capacity < bytes || !same_place(slot.buffer, like)) {
    slot.buffer = like.kind == MemoryKind::kHost
                      ? Buffer::host(carve(like, bytes), bytes)
                      : Buffer::cuda(carve(like, bytes), bytes, like.device);
    slot.capacity = aligned(bytes);
  }
  slot.buffer.bytes = bytes;
  return slot.buffer;
}

void StagingPool::start_sizing() {
  sizing_ = true;
  slots_.clear();
  chunks_.clear();
  sized_.clear();
  sized_by_op_.clear();
  sized_owners_.clear();
  // Made-up addresses in the kernel's half of the address space (x86-64, AArch64), where no
  // memory of this process lies: they never equal a tensor's.
  sized_end_ = std::uintptr_t{0xf} << 60;
}

std::optional<StagingPool::Key> StagingPool::sized_owner(const void* data) const {
  auto it = sized_owners_.find(reinterpret_cast<std::uintptr_t>(data));
  if (it == sized_owners_.end()) return std::nullopt;
  return it->second;
}

std::size_t StagingPool::arrange(const std::function<std::uint32_t(const OpKey&)>& phase_of,
                                 std::uint32_t regions) {
  sizing_ = false;
  // Per place: where each phase has got to, the largest phase of each region, and the bytes of
  // all regions (the arena).
  struct Place {
    Buffer like;
    std::map<std::uint32_t, std::size_t> used;
    std::vector<std::size_t> largest;
    std::size_t arena_bytes = 0;
  };
  std::vector<Place> places;
  auto place_of = [&](const Buffer& like) -> Place& {
    for (Place& p : places) {
      if (same_place(p.like, like)) return p;
    }
    return places.emplace_back(Place{like, {}, std::vector<std::size_t>(regions, 0), 0});
  };
  std::vector<std::size_t> offsets(sized_.size());
  std::vector<std::uint32_t> region_of(sized_.size());
  for (std::size_t i = 0; i < sized_.size(); ++i) {
    const auto [sending, task, index] = sized_[i].key;
    Place& place = place_of(sized_[i].like);
    const std::uint32_t phase = phase_of({sending, task});
    std::size_t& used = place.used[phase];
    offsets[i] = used;
    region_of[i] = phase % regions;
    used += slot_bytes(sized_[i].bytes);
    place.largest[region_of[i]] = std::max(place.largest[region_of[i]], used);
  }
  std::size_t held = 0;
  for (Place& place : places) {
    for (std::size_t bytes : place.largest) place.arena_bytes += bytes;
    held += place.arena_bytes;
  }
  // Each region starts where the ones before it end.
  for (std::size_t i = 0; i < sized_.size(); ++i) {
    const Place& place = place_of(sized_[i].like);
    for (std::uint32_t r = 0; r < region_of[i]; ++r) offsets[i] += place.largest[r];
  }
  // Arenas of places this refit stages nothing in go.
  std::erase_if(arenas_, [&](const Staging& memory) {
    return std::none_of(places.begin(), places.end(), [&](const Place& place) {
      return place.arena_bytes > 0 && same_place(place.like, memory.buffer());
    });
  });
  for (std::size_t i = 0; i < sized_.size(); ++i) {
    const Sized& s = sized_[i];
    Staging& memory = arena(s.like, place_of(s.like).arena_bytes);
    Slot& slot = slots_[s.key];
    slot.buffer = s.like;
    slot.buffer.data = memory.data() + offsets[i];
    slot.buffer.bytes = s.bytes;
    slot.capacity = slot_bytes(s.bytes);
  }
  sized_.clear();
  sized_by_op_.clear();
  sized_owners_.clear();
  return held;
}

Staging& StagingPool::arena(const Buffer& like, std::size_t bytes) {
  for (Staging& memory : arenas_) {
    if (!same_place(memory.buffer(), like)) continue;
    if (memory.buffer().bytes < bytes) memory = Staging(like.kind, like.device, bytes);
    return memory;
  }
  return arenas_.emplace_back(like.kind, like.device, bytes);
}

std::byte* StagingPool::carve(const Buffer& like, std::size_t bytes) {
  const std::size_t need = slot_bytes(bytes);
  std::size_t last_size = 0;
  for (Chunk& chunk : chunks_) {
    if (!same_place(chunk.memory.buffer(), like)) continue;
    last_size = chunk.memory.buffer().bytes;
    if (chunk.memory.buffer().bytes - chunk.used >= need) {
      std::byte* at = chunk.memory.data() + chunk.used;
      chunk.used += need;
      return at;
    }
  }
  // Chunks double up to a cap, so a refit of any size takes a handful of allocations.
  const std::size_t size = std::max(need, std::clamp(2 * last_size, kFirstChunk, kLargestChunk));
  chunks_.push_back({Staging(like.kind, like.device, size), need});
  return chunks_.back().memory.data();
}

std::size_t StagingPool::reserved_bytes() const {
  std::size_t total = 0;
  for (const Chunk& chunk : chunks_) total += chunk.memory.buffer().bytes;
  for (const Staging& memory : arenas_) total += memory.buffer().bytes;
  return total;
}

Staging::Staging(Staging&& other) noexcept : buffer_(std::exchange(other.buffer_, Buffer{})) {}

Staging& Staging::operator=(Staging&& other) noexcept {
  if (this != &other) {
    release();
    buffer_ = std::exchange(other.buffer_, Buffer{});
  }
  return *this;
}

void Staging::release() {
  if (buffer_.data == nullptr) return;
  if (buffer_.kind == MemoryKind::kHost) {
    std::free(buffer_.data);
  } else {
#ifdef RESHARD_WITH_CUDA
    cuda::release(buffer_.device, buffer_.data);
#endif
  }
  buffer_ = Buffer{};
}

BlockCopyBatch::~BlockCopyBatch() {
#ifdef RESHARD_WITH_CUDA
  if (upload_ != nullptr) cuda::destroy_copy_upload(upload_);
#endif
}

void BlockCopyBatch::add_pack(const Buffer& tensor, const BoxView& view, std::size_t element_bytes,
                              const Buffer& out) {
  add(tensor, view, out, dense_rows(view), element_bytes);
}

void BlockCopyBatch::add_unpack(const Buffer& in, const Buffer& tensor, const BoxView& view,
                                std::size_t element_bytes) {
  add(in, dense_rows(view), tensor, view, element_bytes);
}

void BlockCopyBatch::add_copy(const Buffer& from, const Buffer& to, const BoxView& view,
                              std::size_t element_bytes) {
  add(from, view, to, view, element_bytes);
}

void BlockCopyBatch::add(const Buffer& src, const BoxView& src_view, const Buffer& dst,
                         const BoxView& dst_view, std::size_t element_bytes) {
  if (!copies_.empty() &&
      (src.kind != kind_ || (kind_ == MemoryKind::kCuda && src.device != device_))) {
    throw_error(ErrorCode::kInvalidArgument,
                "one PE's tensors must all be host memory or all on one GPU; found " +
                    describe(src) + " beside memory on " +
                    (kind_ == MemoryKind::kHost ? std::string("the host")
                                                : "GPU " + std::to_string(device_)));
  }
  copies_.push_back(block_copy(src, src_view, dst, dst_view, element_bytes));
  kind_ = src.kind;
  device_ = src.device;
  uploaded_ = false;
}

void BlockCopyBatch::clear() {
  copies_.clear();
  uploaded_ = false;
}

void BlockCopyBatch::run(void* stream) {
  if (copies_.empty()) return;
  if (kind_ == MemoryKind::kHost) {
    for (const BlockCopy& copy : copies_) copy_block_host(copy);
    return;
  }
#ifdef RESHARD_WITH_CUDA
  if (upload_ == nullptr) upload_ = cuda::create_copy_upload();
  cuda::run_block_copies(copies_, uploaded_, upload_, stream);
  uploaded_ = true;
#else
  (void)stream;
  throw_error(ErrorCode::kUnsupported, "GPU tensors need a build with CUDA");
#endif
}

}  // namespace reshard::execution
