// Device selection and buffer checks shared by the GPU transports.
#pragma once

#include "reshard/bootstrap.hpp"
#include "reshard/types.hpp"

namespace reshard::cuda {

// RESHARD_DEVICE, else the local rank modulo the visible devices; makes it current.
int select_device(const Bootstrap& bootstrap);
// Throws kInvalidArgument unless `buffer` is CUDA memory of `device`, and says what it is instead.
void check_device_buffer(const Buffer& buffer, int device, const char* transport);

}  // namespace reshard::cuda
