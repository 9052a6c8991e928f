// CopyService made, initialised, asked about and finalised; its requests, schedule, runs and the
// PEs' meeting are in files of their own around its state (copy_service_impl.hpp).
#include "reshard/copy_service.hpp"

#include <optional>

#include "core/env.hpp"
#include "core/transport.hpp"
#include "reshard/error.hpp"
#include "service/copy_service_impl.hpp"
#include "service/service_slot.hpp"
#include "service/test_hooks.hpp"
#include "service/transport_table.hpp"

namespace reshard {

#ifndef RESHARD_WITH_CUDA
int visible_cuda_devices() noexcept { return 0; }
void copy_device_to_host(void*, const void*, std::size_t, int) {
  throw_error(ErrorCode::kUnsupported, "this build has no CUDA support");
}
void copy_host_to_device(void*, const void*, std::size_t, int) {
  throw_error(ErrorCode::kUnsupported, "this build has no CUDA support");
}
#endif

namespace {

// The environment's options, with the transport named in code: RESHARD_TRANSPORT chooses only
// where the code leaves it to the job (kAuto).
CopyServiceOptions environment_with(TransportKind transport) {
  CopyServiceOptions options = CopyServiceOptions::from_environment();
  if (transport != TransportKind::kAuto) options.transport = transport;
  return options;
}

}  // namespace

// The options are checked before the bootstrap connects to the other PEs.
CopyService::CopyService(const CopyServiceOptions& options)
    : CopyService((options.validate(), std::shared_ptr<Bootstrap>(make_default_bootstrap())),
                  options) {}

CopyService::CopyService(std::shared_ptr<Bootstrap> bootstrap, const CopyServiceOptions& options)
    : impl_(std::make_unique<Impl>()) {
  if (!bootstrap) throw_error(ErrorCode::kInvalidArgument, "CopyService needs a bootstrap");
  options.validate();
  impl_->bootstrap = std::move(bootstrap);
  impl_->options = options.with_former_names_applied();
}

CopyService::CopyService(TransportKind transport) : CopyService(environment_with(transport)) {}

CopyService::CopyService(std::shared_ptr<Bootstrap> bootstrap, TransportKind transport)
    : CopyService(std::move(bootstrap), environment_with(transport)) {}

CopyService::~CopyService() { finalize(); }

const CopyServiceOptions& CopyService::options() const { return impl_->options; }

void CopyService::init(LogLevel log_level) {
  impl_->require(impl_->state == State::kCreated, "init()");
  impl_->options.log_level = env::log_level().value_or(log_level);
  init();
}

void CopyService::init() {
  impl_->require(impl_->state == State::kCreated, "init()");
  set_log_level(impl_->options.log_level);
  set_log_pe(impl_->bootstrap->rank());
  impl_->bootstrap->set_timeout(impl_->options.timeout);
  impl_->transport = make_transport(*impl_->bootstrap, impl_->options);
  impl_->verify = impl_->verify || impl_->options.verify;
  impl_->state = State::kInitialized;
  // Once for the job at INFO (PE 0), each PE's own line at DEBUG.
  if (my_pe() == 0) {
    RESHARD_LOG(kInfo, "copy service ready: " << n_pes() << " PE" << (n_pes() > 1 ? "s" : "")
                                              << ", transport " << impl_->transport->name());
  }
  RESHARD_LOG(kDebug, "copy service ready: PE " << my_pe() << " of " << n_pes() << ", transport "
                                                << impl_->transport->name());
}

int CopyService::my_pe() const { return impl_->bootstrap->rank(); }
int CopyService::n_pes() const { return impl_->bootstrap->size(); }
int CopyService::device() const { return impl_->transport ? impl_->transport->device() : -1; }
bool CopyService::initialized() const {
  return impl_->state == State::kInitialized || impl_->state == State::kScheduled;
}
TransportKind CopyService::transport() const { return impl_->options.transport; }
std::string CopyService::transport_name() const {
  return impl_->transport ? impl_->transport->name() : "none";
}

bool CopyService::moves_rows_in_place() const {
  return execution::ServiceSlot::moves_rows_in_place(*this);
}

bool CopyService::waits_in_stream_front_end() const {
  return execution::ServiceSlot::waits_in_stream_front_end(*this);
}

void CopyService::clear_requests() {
  impl_->require_usable("clear_requests()");
  forget_requests(*impl_);
  // execute_reshard_plan's executor goes too, with its staging (on GPUs device memory).
  impl_->attachment.reset();
}

void CopyService::forget_requests(Impl& self) {
  if (self.transport && self.state == State::kScheduled) self.transport->forget_schedule();
  self.scheduled_since_clear = false;
  self.sends.clear();
  self.receives.clear();
  self.plans.clear();
  self.phase = 0;
  self.state = State::kInitialized;
  ++self.generation;
}

std::vector<std::vector<std::byte>> CopyService::all_gather(std::span<const std::byte> mine) {
  return impl_->bootstrap->all_gather(mine);
}

void CopyService::finalize() {
  if (!impl_ || impl_->state == State::kFinalized) return;
  impl_->attachment.reset();  // executors may hold staging that needs the transport's device
  if (impl_->transport) impl_->transport->finalize();
  impl_->transport.reset();
  impl_->sends.clear();
  impl_->receives.clear();
  impl_->plans.clear();
  impl_->state = State::kFinalized;
}

}  // namespace reshard

namespace reshard::test_hooks {

void ServiceProbe::corrupt_receives_after_run(CopyService& service, std::optional<TaskId> victim) {
  CopyService::Impl& self = *service.impl_;
  self.after_transfer = nullptr;
  if (!victim) return;
  self.after_transfer = [&self, task = *victim](std::uint32_t phase) {
    for (const Registration& r : self.receives) {
      if (r.task != task || r.size == 0 || r.phase != phase) continue;
      if (r.buffer.kind == MemoryKind::kHost) {
        *r.start() ^= std::byte{1};
      } else {
        std::byte value;
        copy_device_to_host(&value, r.start(), 1, r.buffer.device);
        value ^= std::byte{1};
        copy_host_to_device(r.start(), &value, 1, r.buffer.device);
      }
    }
  };
}

}  // namespace reshard::test_hooks

namespace reshard::execution {

std::uint64_t ServiceSlot::generation(const CopyService& service) {
  return service.impl_->generation;
}

std::shared_ptr<void>& ServiceSlot::executors(CopyService& service) {
  return service.impl_->attachment;
}

std::vector<std::vector<std::byte>> ServiceSlot::meet(CopyService& service,
                                                      std::span<const std::byte> mine,
                                                      const std::string& call) {
  return reshard::meet(*service.impl_->bootstrap, service.impl_->options, mine, call);
}

void ServiceSlot::begin_run(CopyService& service) { service.impl_->begin_run(); }

void ServiceSlot::run_phase(CopyService& service, std::uint32_t phase, void* cuda_stream) {
  service.impl_->run_phase(phase, cuda_stream, /*begins=*/false);
}

bool ServiceSlot::moves_rows_in_place(const CopyService& service) {
  service.impl_->require_usable("moves_rows_in_place()");
  return service.impl_->transport->caps().strided_rows;
}

bool ServiceSlot::waits_in_stream_front_end(const CopyService& service) {
  service.impl_->require_usable("waits_in_stream_front_end()");
  return service.impl_->transport->caps().front_end_waits;
}

void ServiceSlot::clear_requests(CopyService& service) {
  service.impl_->require_usable("clear_requests()");
  CopyService::forget_requests(*service.impl_);
}

}  // namespace reshard::execution
