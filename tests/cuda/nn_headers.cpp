// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh): the training layer's headers compile for
// device memory with nvcc. What does not work there yet is refused at compile time where it is
// instantiated (host-only losses, host collectives: see host_collective_on_device.cpp).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

int main() { return 0; }

// FSDP's one kernel of its own (nn/fsdp.hpp), instantiated for the device's memory space: its
// device lambda must compile with nvcc.
template void meshlib::nn::detail::add_values<meshlib::default_memory_space, float>(float*, const float*, std::size_t);
