// Every PE sends 1 MiB to the next PE in a ring and checks what it received from the previous one.
// Run: build/reshard-run -n 4 build/examples/ring_exchange
#include <cstdio>
#include <vector>

#include "reshard/reshard.hpp"

int main() {
  // Host memory goes over the host transport. (The default, kAuto, takes the GPU transports
  // where every PE has a GPU, and those refuse host buffers.) Bootstraps from RANK / WORLD_SIZE /
  // MASTER_ADDR / MASTER_PORT.
  reshard::CopyService service(reshard::TransportKind::kHost);
  service.init("INFO");
  const int me = service.my_pe(), n = service.n_pes();
  const int next = (me + 1) % n, previous = (me + n - 1) % n;

  std::vector<unsigned char> src(1 << 20, static_cast<unsigned char>(me)), dst(1 << 20, 0xff);
  // Task ids are global: the send of PE p and the receive of PE p+1 share id p.
  service.register_send(me, reshard::Buffer::host(src.data(), src.size()), 0, src.size(), next);
  service.register_receive(previous, reshard::Buffer::host(dst.data(), dst.size()), 0, dst.size(),
                           previous);
  service.schedule();                                  // once
  for (int step = 0; step < 3; ++step) service.run();  // as often as needed

  for (unsigned char byte : dst) {
    if (byte != previous) {
      std::fprintf(stderr, "PE %d: wrong byte %d\n", me, byte);
      return 1;
    }
  }
  std::printf("PE %d received 1 MiB from PE %d\n", me, previous);
  service.finalize();
  return 0;
}
