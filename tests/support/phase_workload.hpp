// A schedule in phases whose receives all land in one scratch buffer that every phase reuses:
// in phase p each PE sends a block to every PE (itself included), and every PE receives block
// (p, from q) at q's place in its scratch. A last, sparse phase has only PE 0 send (to the last
// PE, into the scratch's tail): the other PEs have nothing to move in it and still run it.
// Shared by the host and the GPU copy-service tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reshard/copy_service.hpp"

namespace reshard::testing_support {

struct PhaseWorkload {
  int n_pes = 1;
  std::uint32_t dense_phases = 4;  // then one sparse phase
  std::size_t block = 3001;        // odd: no span is a multiple of a vector

  std::uint32_t phases() const { return dense_phases + 1; }
  std::size_t send_bytes() const { return (dense_phases * n_pes + 1) * block; }
  // One block per source PE, then the sparse phase's tail.
  std::size_t scratch_bytes() const { return (n_pes + 1) * block; }
  TaskId task(std::uint32_t phase, PeId src, PeId dst) const {
    return (static_cast<TaskId>(phase) * n_pes + src) * n_pes + dst + 1;
  }
  // Byte i of the block PE `src` sends PE `dst` in `phase` at run `iteration`.
  static std::byte value(std::uint32_t iteration, std::uint32_t phase, PeId src, PeId dst,
                         std::size_t i) {
    return static_cast<std::byte>((iteration * 131 + phase * 71 + src * 37 + dst * 13 + i * 7) %
                                  251);
  }

  // Registers PE `me`'s requests: `source` holds send_bytes(), `scratch` scratch_bytes().
  void register_on(CopyService& service, const Buffer& source, const Buffer& scratch) const {
    const PeId me = service.my_pe();
    for (std::uint32_t p = 0; p < dense_phases; ++p) {
      service.set_phase(p);
      for (PeId q = 0; q < n_pes; ++q) {
        service.register_send(task(p, me, q), source, (p * n_pes + q) * block, block, q);
        service.register_receive(task(p, q, me), scratch, q * block, block, q);
      }
    }
    service.set_phase(dense_phases);
    const PeId last = n_pes - 1;
    if (me == 0) {
      service.register_send(task(dense_phases, 0, last), source, dense_phases * n_pes * block,
                            block, last);
    }
    if (me == last) {
      service.register_receive(task(dense_phases, 0, last), scratch, n_pes * block, block, 0);
    }
  }

  std::vector<std::byte> source(PeId me, std::uint32_t iteration) const {
    std::vector<std::byte> bytes(send_bytes());
    for (std::uint32_t p = 0; p < dense_phases; ++p) {
      for (PeId q = 0; q < n_pes; ++q) {
        for (std::size_t i = 0; i < block; ++i)
          bytes[(p * n_pes + q) * block + i] = value(iteration, p, me, q, i);
      }
    }
    for (std::size_t i = 0; i < block; ++i)
      bytes[dense_phases * n_pes * block + i] = value(iteration, dense_phases, me, n_pes - 1, i);
    return bytes;
  }

  // Bytes of PE `me`'s scratch after `phase` ran, that differ from what it must hold there (the
  // blocks of that phase; after the sparse phase its tail, on the last PE).
  std::size_t wrong_after(PeId me, std::uint32_t iteration, std::uint32_t phase,
                          const std::vector<std::byte>& scratch) const {
    std::size_t wrong = 0;
    if (phase < dense_phases) {
      for (PeId q = 0; q < n_pes; ++q) {
        for (std::size_t i = 0; i < block; ++i)
          wrong += scratch[q * block + i] != value(iteration, phase, q, me, i);
      }
    } else if (me == n_pes - 1) {
      for (std::size_t i = 0; i < block; ++i)
        wrong += scratch[n_pes * block + i] != value(iteration, phase, 0, me, i);
    }
    return wrong;
  }
};

}  // namespace reshard::testing_support
