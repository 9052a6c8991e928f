// reshard._core's errors (ReshardError and Ctrl-C), bootstraps, local launcher, options and copy
// service.
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <thread>

#include "bindings/arrays.hpp"
#include "bindings/bindings.hpp"
#include "core/env.hpp"
#include "core/interrupt.hpp"
#include "launch/local_launcher.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/options.hpp"
#include "service/service_slot.hpp"
#include "service/test_hooks.hpp"

using namespace nb::literals;

namespace reshard::python {

// The thread Python handles signals on: reshard's waits there run Python's signal handlers (so
// Ctrl-C raises KeyboardInterrupt in a blocked init(), schedule() or run()); other threads have
// none to run.
std::thread::id python_main_thread;

bool python_interrupted() {
  if (std::this_thread::get_id() != python_main_thread || !Py_IsInitialized()) return false;
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PyErr_Clear();  // raised again as KeyboardInterrupt once the wait has ended (bind_errors)
  return true;
}

namespace {

// An all-gather's parts, in PE order, as a list of Python bytes.
nb::list bytes_list(const std::vector<std::vector<std::byte>>& parts) {
  nb::list out;
  for (const auto& part : parts)
    out.append(nb::bytes(reinterpret_cast<const char*>(part.data()), part.size()));
  return out;
}

}  // namespace

// An exception class of reshard._core: `bases` a class or a tuple of them; `code` the class's
// default code (the library sets each instance's own).
nb::object exception_class(nb::module_& m, const char* name, const char* doc, nb::handle bases,
                           const char* code) {
  nb::dict attributes;
  attributes["code"] = nb::str(code);
  attributes["tasks"] = nb::tuple();
  attributes["retryable"] = nb::bool_(false);
  const std::string qualified = std::string("reshard._core.") + name;
  nb::object type =
      nb::steal(PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), attributes.ptr()));
  if (!type.is_valid()) throw nb::python_error();
  m.attr(name) = type;
  return type;
}

void bind_errors(nb::module_& m) {
  // One hierarchy: every error reshard raises is a ReshardError (a RuntimeError, `code` naming
  // its kind), and where a kind means what a built-in exception means, it is that too, so
  // `except ValueError` / `except TimeoutError` catch them as Python code expects.
  static nb::object base = exception_class(
      m, "ReshardError",
      "An error raised by reshard; `code` names its kind (reshard.ErrorCode's values) and "
      "`tasks` lists the task ids involved, if any.",
      PyExc_RuntimeError, "");
  const auto derived = [&](const char* name, const char* doc, nb::handle builtin,
                           const char* code) {
    return exception_class(m, name, doc, nb::make_tuple(base, builtin), code);
  };
  static nb::object invalid_argument =
      derived("InvalidArgumentError",
              "A call was given something malformed, or requests that do not "
              "form a consistent transfer set (a ValueError too).",
              PyExc_ValueError, "invalid argument");
  static nb::object type_error = exception_class(
      m, "ReshardTypeError",
      "A call was given an object of a type it does not take (a TypeError "
      "too).",
      nb::make_tuple(invalid_argument, nb::handle(PyExc_TypeError)), "invalid argument");
  static nb::object timeout = derived(
      "ReshardTimeoutError", "A peer did not answer or arrive in time (a TimeoutError too).",
      PyExc_TimeoutError, "timeout");
  static nb::object unsupported = derived("UnsupportedError",
                                          "This build or transport lacks what was asked for (a "
                                          "NotImplementedError too).",
                                          PyExc_NotImplementedError, "unsupported");
  const auto plain = [&](const char* name, const char* doc, const char* code) {
    return exception_class(m, name, doc, base, code);
  };
  static nb::object invalid_state =
      plain("InvalidStateError", "A call out of order, or on something no longer usable.",
            "invalid state");
  static nb::object peer_failure =
      plain("PeerFailureError", "A peer died or aborted.", "peer failure");
  static nb::object integrity = plain(
      "IntegrityError", "Verify mode: bytes arrived different from what was sent.", "integrity");
  static nb::object system_call =
      derived("SystemCallError", "An operating-system or driver call failed (an OSError too).",
              PyExc_OSError, "system");
  (void)type_error;
  static const std::pair<ErrorCode, nb::handle> classes[] = {
      {ErrorCode::kInvalidArgument, invalid_argument},
      {ErrorCode::kValidation, invalid_argument},
      {ErrorCode::kTimeout, timeout},
      {ErrorCode::kUnsupported, unsupported},
      {ErrorCode::kInvalidState, invalid_state},
      {ErrorCode::kPeerFailure, peer_failure},
      {ErrorCode::kIntegrity, integrity},
      {ErrorCode::kSystem, system_call}};
  nb::register_exception_translator([](const std::exception_ptr& thrown, void*) {
    try {
      std::rethrow_exception(thrown);
    } catch (const Error& error) {
      if (error.code() == ErrorCode::kInterrupted) {
        PyErr_SetString(PyExc_KeyboardInterrupt, error.what());
        return;
      }
      nb::handle type = base;
      for (const auto& [code, kind] : classes) {
        if (code == error.code()) type = kind;
      }
      nb::object instance = type(nb::str(error.what()));
      instance.attr("code") = nb::str(error_code_name(error.code()));
      instance.attr("tasks") = nb::cast(error.tasks());
      instance.attr("retryable") = nb::bool_(error.retryable());
      PyErr_SetObject(type.ptr(), instance.ptr());
    }
  });
}

void bind_bootstrap(nb::module_& m) {
  nb::class_<Bootstrap>(m, "Bootstrap")
      .def_prop_ro("rank", &Bootstrap::rank)
      .def_prop_ro("size", &Bootstrap::size)
      .def_prop_ro("local_rank", &Bootstrap::local_rank)
      .def("barrier", &Bootstrap::barrier, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "all_gather",
          [](Bootstrap& self, nb::bytes mine) {
            std::vector<std::vector<std::byte>> parts;
            {
              nb::gil_scoped_release released;
              parts =
                  self.all_gather({reinterpret_cast<const std::byte*>(mine.c_str()), mine.size()});
            }
            return bytes_list(parts);
          },
          "mine"_a);
  m.def(
      "tcp_bootstrap",
      [](const std::string& address, int port, int rank, int size, int local_rank) {
        TcpBootstrapOptions options;
        options.address = address;
        options.port = port;
        options.rank = rank;
        options.size = size;
        options.local_rank = local_rank;
        options.timeout = env::timeout();
        return std::shared_ptr<Bootstrap>(std::make_shared<TcpBootstrap>(options));
      },
      "address"_a, "port"_a, "rank"_a, "size"_a, "local_rank"_a,
      nb::call_guard<nb::gil_scoped_release>());
  m.def("make_unique_id", &TcpBootstrap::make_unique_id, "host"_a = "127.0.0.1");
  m.def(
      "default_bootstrap", [] { return std::shared_ptr<Bootstrap>(make_default_bootstrap()); },
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "mpi_bootstrap", [] { return std::shared_ptr<Bootstrap>(make_mpi_bootstrap()); },
      nb::call_guard<nb::gil_scoped_release>());
  m.def("mpi_bootstrap_available", &mpi_bootstrap_available);
}

// The local launcher (src/launch) behind `python -m reshard.launch`: the same one reshard-run
// uses. The job's output goes to this process's stdout and stderr; the GIL is released while it
// runs.
void bind_launcher(nb::module_& m) {
  m.def(
      "launch_local",
      [](std::vector<std::string> command, int nprocs, double timeout_s, double grace_s,
         std::optional<std::vector<std::string>> environment) {
        LaunchOptions options;
        options.n_procs = nprocs;
        options.command = std::move(command);
        options.time_limit = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1e3));
        options.kill_grace = std::chrono::milliseconds(static_cast<long long>(grace_s * 1e3));
        options.environment = std::move(environment);
        options.name = "reshard.launch";
        const LaunchResult result = launch_local(options);
        return std::make_tuple(result.exit_code, result.first_failed_rank, result.summary);
      },
      "command"_a, "nprocs"_a, "timeout_s"_a = 0.0, "grace_s"_a = 5.0, "environment"_a = nb::none(),
      nb::call_guard<nb::gil_scoped_release>(),
      "Runs command as nprocs local processes with torchrun's variables; returns (exit code, "
      "first failed rank or -1, summary).");
}

namespace {

// CopyServiceOptions with Python's units: the timeout in seconds, transports and log levels by
// name; reshard/copy_service.py turns CopyService's keywords into it.
void bind_options(nb::module_& m) {
  m.def("parse_bytes", &parse_bytes, "text"_a, "A byte count such as '64KiB' or '1.5GB'.");
  nb::class_<HostTransportOptions>(m, "HostTransportOptions")
      .def_rw("staging_bytes", &HostTransportOptions::staging_bytes);
  // Each transport's group, and the advanced one. The former names (one release) stay readable and
  // settable; reshard/copy_service.py warns where a caller sets one.
  nb::class_<CudaTransportOptions>(m, "CudaTransportOptions")
      .def_rw("engine", &CudaTransportOptions::engine)
      .def_rw("same_device", &CudaTransportOptions::same_device)
      .def_rw("ce_min_bytes", &CudaTransportOptions::ce_min_bytes)
      .def_rw("ctas_per_peer", &CudaTransportOptions::ctas_per_peer)
      .def_rw("bytes_per_cta", &CudaTransportOptions::bytes_per_cta);
  nb::class_<NcclTransportOptions>(m, "NcclTransportOptions")
      .def_rw("nonblocking", &NcclTransportOptions::nonblocking)
      .def_rw("group_spans", &NcclTransportOptions::group_spans);
  nb::class_<NvshmemTransportOptions>(m, "NvshmemTransportOptions")
      .def_rw("staging_bytes", &NvshmemTransportOptions::staging_bytes)
      .def_rw("waits", &NvshmemTransportOptions::waits);
  nb::class_<AdvancedOptions>(m, "AdvancedOptions")
      .def_rw("cuda_ce_min_bytes", &AdvancedOptions::cuda_ce_min_bytes)
      .def_rw("cuda_ctas_per_peer", &AdvancedOptions::cuda_ctas_per_peer)
      .def_rw("cuda_bytes_per_cta", &AdvancedOptions::cuda_bytes_per_cta)
      .def_rw("cuda_ce_streams", &AdvancedOptions::cuda_ce_streams)
      .def_rw("cuda_unroll", &AdvancedOptions::cuda_unroll)
      .def_rw("cuda_early_launch", &AdvancedOptions::cuda_early_launch)
      .def_rw("cuda_batch_memops", &AdvancedOptions::cuda_batch_memops)
      .def_rw("nccl_group_spans", &AdvancedOptions::nccl_group_spans)
      .def_rw("nvshmem_direct", &AdvancedOptions::nvshmem_direct)
      .def_rw("nvshmem_send_stream", &AdvancedOptions::nvshmem_send_stream)
      .def_rw("nvshmem_peers_per_round", &AdvancedOptions::nvshmem_peers_per_round)
      .def_rw("pipelined_phases", &AdvancedOptions::pipelined_phases)
      .def_rw("cuda_trace", &AdvancedOptions::cuda_trace)
      .def_rw("nvshmem_trace", &AdvancedOptions::nvshmem_trace)
      .def_rw("step_timing", &AdvancedOptions::step_timing);
  nb::class_<DebugOptions>(m, "DebugOptions")
      .def_rw("cuda_trace", &DebugOptions::cuda_trace)
      .def_rw("nvshmem_trace", &DebugOptions::nvshmem_trace)
      .def_rw("phase_timing", &DebugOptions::phase_timing)
      .def_rw("pipelined_phases", &DebugOptions::pipelined_phases)
      .def_rw("cuda_ce_streams", &DebugOptions::cuda_ce_streams)
      .def_rw("cuda_unroll", &DebugOptions::cuda_unroll)
      .def_rw("cuda_early_launch", &DebugOptions::cuda_early_launch)
      .def_rw("cuda_batch_memops", &DebugOptions::cuda_batch_memops)
      .def_rw("nvshmem_direct", &DebugOptions::nvshmem_direct)
      .def_rw("nvshmem_send_stream", &DebugOptions::nvshmem_send_stream)
      .def_rw("nvshmem_peers_per_round", &DebugOptions::nvshmem_peers_per_round);
  nb::class_<CopyServiceOptions>(m, "CopyServiceOptions")
      .def(nb::init<>())
      .def_static("from_environment", &CopyServiceOptions::from_environment)
      .def("validate", &CopyServiceOptions::validate)
      .def_prop_rw(
          "transport", [](const CopyServiceOptions& o) { return transport_kind_name(o.transport); },
          [](CopyServiceOptions& o, const std::string& name) {
            o.transport = parse_transport_kind(name);
          })
      .def_prop_rw(
          "inter_node_transport",
          [](const CopyServiceOptions& o) -> std::optional<std::string> {
            if (!o.inter_node_transport) return std::nullopt;
            return transport_kind_name(*o.inter_node_transport);
          },
          [](CopyServiceOptions& o, std::optional<std::string> name) {
            o.inter_node_transport.reset();
            if (name) o.inter_node_transport = parse_transport_kind(*name);
          })
      .def_rw("node_size", &CopyServiceOptions::node_size)
      .def_rw("device", &CopyServiceOptions::device)
      .def_prop_rw(
          "timeout", [](const CopyServiceOptions& o) { return o.timeout.count() / 1000.0; },
          [](CopyServiceOptions& o, double seconds) {
            o.timeout = std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
          },
          "seconds")
      .def_prop_rw(
          "arrival_timeout",
          [](const CopyServiceOptions& o) { return o.arrival_timeout.count() / 1000.0; },
          [](CopyServiceOptions& o, double seconds) {
            o.arrival_timeout = std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
          },
          "seconds")
      .def_rw("verify", &CopyServiceOptions::verify)
      .def_rw("chunk_bytes", &CopyServiceOptions::chunk_bytes)
      .def_prop_rw(
          "log_level", [](const CopyServiceOptions& o) { return log_level_name(o.log_level); },
          [](CopyServiceOptions& o, const std::string& name) {
            o.log_level = parse_log_level(name);
          })
      .def_rw("host", &CopyServiceOptions::host)
      .def_rw("cuda", &CopyServiceOptions::cuda)
      .def_rw("nccl", &CopyServiceOptions::nccl)
      .def_rw("nvshmem", &CopyServiceOptions::nvshmem)
      .def_rw("advanced", &CopyServiceOptions::advanced)
      .def_rw("debug", &CopyServiceOptions::debug)
      .def("with_former_names_applied", &CopyServiceOptions::with_former_names_applied)
      .def_static("former_names", &CopyServiceOptions::former_names);
}

}  // namespace

void bind_copy_service(nb::module_& m) {
  bind_options(m);
  // reshard's own tests of verify mode (not part of the API).
  m.def("_corrupt_receives_after_run", &test_hooks::ServiceProbe::corrupt_receives_after_run,
        "service"_a, "task"_a.none());
  m.def("available_transports", &available_transports);
  m.def("component_versions", &component_versions,
        "What this build runs on, found at run time: reshard, CUDA runtime and driver, NCCL, "
        "NVSHMEM (those built in).");
  nb::class_<ScheduleReport>(m, "ScheduleReport")
      .def_ro("transfers", &ScheduleReport::transfers)
      .def_ro("batches", &ScheduleReport::batches)
      .def_ro("rounds", &ScheduleReport::rounds)
      .def_ro("lower_bound_bytes", &ScheduleReport::lower_bound_bytes)
      .def_ro("makespan_bytes", &ScheduleReport::makespan_bytes)
      .def_ro("bytes_sent", &ScheduleReport::bytes_sent)
      .def_ro("bytes_received", &ScheduleReport::bytes_received)
      .def_ro("bytes_local", &ScheduleReport::bytes_local)
      .def_ro("phases", &ScheduleReport::phases)
      .def_prop_ro("bound_ratio", &ScheduleReport::bound_ratio);

  using GilFree = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<CopyService>(m, "CopyService")
      .def(
          "__init__",
          [](CopyService* self, const std::string& transport, std::shared_ptr<Bootstrap> bootstrap,
             std::optional<CopyServiceOptions> options) {
            const TransportKind kind = parse_transport_kind(transport);
            nb::gil_scoped_release released;
            if (!bootstrap) bootstrap = make_default_bootstrap();
            if (options) {
              // As the constructor without options: a transport named in code wins;
              // RESHARD_TRANSPORT (the options' default) chooses where the code says "auto".
              if (kind != TransportKind::kAuto) options->transport = kind;
              new (self) CopyService(std::move(bootstrap), *options);
            } else {
              new (self) CopyService(std::move(bootstrap), kind);
            }
          },
          "transport"_a = "auto", "bootstrap"_a = nb::none(), "options"_a = nb::none())
      .def_prop_ro("options", [](const CopyService& self) { return self.options(); })
      .def("init", nb::overload_cast<const std::string&>(&CopyService::init), "log_level"_a,
           GilFree())
      .def("init", nb::overload_cast<>(&CopyService::init), GilFree())
      .def_prop_ro("my_pe", &CopyService::my_pe)
      .def_prop_ro("n_pes", &CopyService::n_pes)
      .def_prop_ro("device", &CopyService::device)
      .def_prop_ro("initialized", &CopyService::initialized)
      .def_prop_ro("transport_name", &CopyService::transport_name)
      .def_prop_ro("_generation",  // for tests: changes whenever the requests change
                   [](const CopyService& self) { return execution::ServiceSlot::generation(self); })
      .def(
          "register_send",
          [](CopyService& self, TaskId task, nb::handle src, std::size_t pos, std::size_t size,
             PeId dest, const std::vector<std::uint64_t>& rows,
             const std::vector<std::uint64_t>& pitches) {
            self.register_send(task, registered_buffer<ReadOnlyArray>(src, task, "send"),
                               strided_range(task, pos, size, rows, pitches), dest);
          },
          "task_id"_a, "src"_a, "src_pos"_a, "size"_a, "dest_pe"_a,
          "rows"_a = std::vector<std::uint64_t>{}, "pitches"_a = std::vector<std::uint64_t>{})
      .def(
          "register_receive",
          [](CopyService& self, TaskId task, nb::handle dst, std::size_t pos, std::size_t size,
             PeId src, const std::vector<std::uint64_t>& rows,
             const std::vector<std::uint64_t>& pitches) {
            self.register_receive(task, registered_buffer<Array>(dst, task, "receive"),
                                  strided_range(task, pos, size, rows, pitches), src);
          },
          "task_id"_a, "dst"_a, "dst_pos"_a, "size"_a, "src_pe"_a,
          "rows"_a = std::vector<std::uint64_t>{}, "pitches"_a = std::vector<std::uint64_t>{})
      .def_prop_ro(
          "moves_rows_in_place",
          [](const CopyService& self) { return execution::ServiceSlot::moves_rows_in_place(self); })
      .def_prop_ro("waits_in_stream_front_end",
                   [](const CopyService& self) {
                     return execution::ServiceSlot::waits_in_stream_front_end(self);
                   })
      .def("schedule", &CopyService::schedule, GilFree())
      .def(
          "run",
          [](CopyService& self, std::optional<std::uintptr_t> stream) {
            if (stream) {
              self.run(stream_of(stream));
            } else {
              self.run();
            }
          },
          "stream"_a = nb::none(), GilFree())
      .def("set_phase", &CopyService::set_phase, "phase"_a)
      .def_prop_ro("phases", &CopyService::phases)
      .def(
          "run_phase",
          [](CopyService& self, std::uint32_t phase, std::optional<std::uintptr_t> stream) {
            self.run_phase(phase, stream ? stream_of(stream) : nullptr);
          },
          "phase"_a, "stream"_a = nb::none(), GilFree())
      .def("synchronize", &CopyService::synchronize, GilFree())
      .def(
          "_meet",
          [](CopyService& self, nb::bytes mine, const std::string& call) {
            std::vector<std::vector<std::byte>> parts;
            {
              nb::gil_scoped_release released;
              parts = execution::ServiceSlot::meet(
                  self, {reinterpret_cast<const std::byte*>(mine.c_str()), mine.size()}, call);
            }
            return bytes_list(parts);
          },
          "mine"_a, "call"_a)
      .def_prop_rw("verify", &CopyService::verify, &CopyService::set_verify)
      .def("clear_requests", &CopyService::clear_requests, GilFree())
      .def("finalize", &CopyService::finalize, GilFree());
}

}  // namespace reshard::python
