// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The parts of the NCCL backend that need no GPU: they run in CI, where CUDA and NCCL are
// installed but no device is.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <meshlib/nccl.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

using meshlib_test::message_of;
namespace ml = meshlib;

// ---- type and op mapping -------------------------------------------------------------------------

static_assert(ml::communicator<ml::nccl_communicator>);
static_assert(ml::nccl_datatype_of<float> == ncclFloat32);
static_assert(ml::nccl_datatype_of<double> == ncclFloat64);
static_assert(ml::nccl_datatype_of<std::int32_t> == ncclInt32);
static_assert(ml::nccl_datatype_of<std::int64_t> == ncclInt64);
static_assert(ml::nccl_datatype_of<long long> == ncclInt64);
static_assert(ml::nccl_datatype_of<const float> == ncclFloat32);
static_assert(ml::nccl_datatype_of<ml::bfloat16> == ncclBfloat16);
static_assert(ml::nccl_datatype_of<__half> == ncclFloat16);
static_assert(ml::nccl_datatype_of<__nv_bfloat16> == ncclBfloat16);
static_assert(!ml::nccl_element<unsigned>);
static_assert(!ml::nccl_element<char>);
static_assert(!ml::nccl_element<std::uint64_t>);
static_assert(!ml::nccl_element<bool>);

TEST_CASE("nccl: every meshlib datatype maps to the NCCL type of the same size and kind", "[nccl]") {
  // NCCL's own sizes, written out independently of meshlib's table.
  auto nccl_size = [](ncclDataType_t t) -> std::size_t {
    switch (t) {
      case ncclInt32: case ncclFloat32: return 4;
      case ncclInt64: case ncclFloat64: return 8;
      case ncclFloat16: case ncclBfloat16: return 2;
      default: return 0;
    }
  };
  for (ml::datatype t : ml::all_datatypes) {
    INFO(ml::to_string(t));
    CHECK(nccl_size(ml::to_nccl(t)) == ml::size_of(t));
  }
  CHECK(ml::to_nccl(ml::datatype_of<float>) == ml::nccl_datatype_of<float>);
  CHECK(ml::to_nccl(ml::datatype_of<double>) == ml::nccl_datatype_of<double>);
  CHECK(ml::to_nccl(ml::datatype_of<std::int32_t>) == ml::nccl_datatype_of<std::int32_t>);
  CHECK(ml::to_nccl(ml::datatype_of<std::int64_t>) == ml::nccl_datatype_of<std::int64_t>);
  CHECK(ml::to_nccl(ml::datatype_of<ml::bfloat16>) == ml::nccl_datatype_of<ml::bfloat16>);
  // meshlib's bfloat16 and CUDA's have the same bits for the same value, so NCCL reduces either.
  CHECK(sizeof(ml::bfloat16) == sizeof(__nv_bfloat16));
}

TEST_CASE("nccl: reduce ops map to NCCL's, avg to ncclAvg", "[nccl]") {
  CHECK(ml::to_nccl(ml::reduce_op::sum) == ncclSum);
  CHECK(ml::to_nccl(ml::reduce_op::prod) == ncclProd);
  CHECK(ml::to_nccl(ml::reduce_op::min) == ncclMin);
  CHECK(ml::to_nccl(ml::reduce_op::max) == ncclMax);
  CHECK(ml::to_nccl(ml::reduce_op::mean) == ncclAvg);
  std::vector<ncclRedOp_t> seen;
  for (ml::reduce_op op : ml::all_reduce_ops) seen.push_back(ml::to_nccl(op));
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());  // no two ops share an NCCL op
}

// ---- error translation ---------------------------------------------------------------------------

TEST_CASE("nccl: NCCL results become meshlib exceptions naming the operation, the call and NCCL's text", "[nccl]") {
  using ml::comm::detail::check_nccl;
  const std::string where = "all_reduce on NCCL rank 1 of 4 (GPU 1)";
  CHECK_NOTHROW(check_nccl(ncclSuccess, where, "ncclAllReduce"));
  CHECK_NOTHROW(check_nccl(ncclInProgress, where, "ncclAllReduce"));  // non-blocking: settled by the caller

  CHECK(message_of<ml::comm_argument_error>([&] { check_nccl(ncclInvalidArgument, where, "ncclAllReduce", "bad count"); }) ==
        "meshlib: all_reduce on NCCL rank 1 of 4 (GPU 1): ncclAllReduce failed: ncclInvalidArgument (invalid "
        "argument (run with NCCL_DEBUG=WARN for details)): bad count");
  CHECK(message_of<ml::comm_argument_error>([&] { check_nccl(ncclInvalidUsage, where, "ncclSend"); }) ==
        "meshlib: all_reduce on NCCL rank 1 of 4 (GPU 1): ncclSend failed: ncclInvalidUsage (invalid usage (run with "
        "NCCL_DEBUG=WARN for details))");
  CHECK(message_of<ml::comm_aborted>([&] { check_nccl(ncclRemoteError, where, "ncclAllReduce"); }) ==
        "meshlib: all_reduce on NCCL rank 1 of 4 (GPU 1): ncclAllReduce failed: ncclRemoteError (remote process exited "
        "or there was a network error)");
  // The rest are comm_error itself, not one of its more specific subclasses.
  for (ncclResult_t rc : {ncclUnhandledCudaError, ncclSystemError, ncclInternalError}) {
    INFO(static_cast<int>(rc));
    try {
      check_nccl(rc, where, "ncclAllReduce");
      FAIL("no exception");
    } catch (const ml::comm_argument_error&) {
      FAIL("argument error");
    } catch (const ml::comm_aborted&) {
      FAIL("aborted");
    } catch (const ml::comm_error& e) {
      CHECK(std::string(e.what()).starts_with("meshlib: all_reduce on NCCL rank 1 of 4 (GPU 1): ncclAllReduce failed: ncclUnhandledCudaError (") ==
            (rc == ncclUnhandledCudaError));
      CHECK(std::string(e.what()).find(ncclGetErrorString(rc)) != std::string::npos);
    }
  }
}

TEST_CASE("nccl: CUDA errors become meshlib exceptions with CUDA's name and text", "[nccl]") {
  using ml::comm::detail::check_cuda;
  CHECK_NOTHROW(check_cuda(cudaSuccess, "x", "cudaMalloc"));
  CHECK(message_of<ml::comm_argument_error>([] { check_cuda(cudaErrorInvalidValue, "broadcast on NCCL rank 0 of 2 (GPU 0)", "cudaMemcpyAsync"); }) ==
        "meshlib: broadcast on NCCL rank 0 of 2 (GPU 0): cudaMemcpyAsync failed: cudaErrorInvalidValue (invalid argument)");
  CHECK(message_of<ml::comm_error>([] { check_cuda(cudaErrorNoDevice, "nccl_communicator", "cudaGetDeviceCount"); }) ==
        "meshlib: nccl_communicator: cudaGetDeviceCount failed: cudaErrorNoDevice (no CUDA-capable device is detected)");
  CHECK(message_of<ml::comm_error>([] { check_cuda(cudaErrorMemoryAllocation, "all_to_all", "cudaMallocAsync"); }) ==
        "meshlib: all_to_all: cudaMallocAsync failed: cudaErrorMemoryAllocation (out of memory)");
}

// ---- the NCCL version: parsed, compared, and an old library refused -------------------------------

static_assert(ml::nccl_version_number::from_code(22809) == ml::nccl_version_number{2, 28, 9});
static_assert(ml::nccl_header_version().code() == NCCL_VERSION_CODE);

TEST_CASE("nccl version: codes of both of NCCL's schemes parse, and code() writes them back", "[nccl][version]") {
  using v = ml::nccl_version_number;
  // Since 2.9: major * 10000 + minor * 100 + patch; before: major * 1000 + minor * 100 + patch.
  CHECK(v::from_code(22809) == v{2, 28, 9});
  CHECK(v::from_code(22803) == v{2, 28, 3});
  CHECK(v::from_code(21800) == v{2, 18, 0});
  CHECK(v::from_code(20900) == v{2, 9, 0});
  CHECK(v::from_code(2708) == v{2, 7, 8});
  CHECK(v::from_code(2406) == v{2, 4, 6});
  CHECK(v::from_code(30102) == v{3, 1, 2});
  // Every version NCCL can write comes back from its code, as NCCL_VERSION(X, Y, Z) computes it.
  for (int major = 1; major <= 3; ++major)
    for (int minor = 0; minor <= 99; ++minor)
      for (int patch : {0, 1, 9, 42, 99}) {
        const v x{major, minor, patch};
        INFO(x);
        CHECK(x.code() == NCCL_VERSION(major, minor, patch));
        CHECK(v::from_code(x.code()) == x);
      }
  CHECK(v{2, 28, 9}.to_string() == "2.28.9");
  std::ostringstream os;
  os << v{2, 18, 0};
  CHECK(os.str() == "2.18.0");
  CHECK(v{2, 9, 0} > v{2, 8, 4});
  CHECK(v{2, 28, 3} < v{2, 28, 9});
  CHECK(v{2, 17, 99} < ml::nccl_min_version);
  CHECK(ml::nccl_min_version == v{2, 18, 0});
  CHECK(ml::nccl_header_version() >= ml::nccl_min_version);
}

TEST_CASE("nccl version: the library this process loads is read, and is one meshlib accepts here", "[nccl][version]") {
  const auto library = ml::nccl_version();
  int code = 0;
  REQUIRE(ncclGetVersion(&code) == ncclSuccess);
  CHECK(library.code() == code);
  CHECK_NOTHROW(ml::comm::detail::require_nccl_version("nccl_communicator"));
  CHECK(ml::comm::detail::nccl_versions_text({2, 28, 3}, {2, 28, 9}) == "NCCL library 2.28.3, headers 2.28.9");
}

TEST_CASE("nccl version: a library older than 2.18 is refused naming it, the minimum and the fix; newer headers are fine",
          "[nccl][version]") {
  using v = ml::nccl_version_number;
  // Headers newer than the library (a wheel's older libnccl.so.2 first on the path): accepted.
  CHECK(ml::comm::detail::nccl_version_problem("nccl_communicator", v{2, 28, 3}, v{2, 28, 9}).empty());
  CHECK(ml::comm::detail::nccl_version_problem("nccl_communicator", v{2, 18, 0}, v{2, 28, 9}).empty());
  CHECK(ml::comm::detail::nccl_version_problem("nccl_communicator", v{2, 30, 1}, v{2, 28, 9}).empty());
  CHECK_NOTHROW(ml::comm::detail::require_nccl_version("nccl_communicator", v{2, 28, 3}, v{2, 28, 9}));
  const std::string expected =
      "meshlib: nccl_communicators: the NCCL library this process loaded is 2.17.1, older than 2.18.0, the oldest "
      "meshlib supports (it calls ncclCommSplit, new in 2.18; meshlib was compiled against NCCL 2.28.9 headers); "
      "install a newer NCCL (pip install -U nvidia-nccl-cu13, or your CUDA toolkit's NCCL) and make sure its "
      "libnccl.so.2 is the one loaded (LD_LIBRARY_PATH)";
  CHECK(ml::comm::detail::nccl_version_problem("nccl_communicators", v{2, 17, 1}, v{2, 28, 9}) == expected);
  CHECK(message_of<ml::comm_error>([] { ml::comm::detail::require_nccl_version("nccl_communicators", v{2, 17, 1}, v{2, 28, 9}); }) ==
        expected);
  CHECK(message_of<ml::comm_error>([] { ml::comm::detail::require_nccl_version("nccl_communicator", v{2, 7, 8}, v{2, 28, 9}); }) ==
        "meshlib: nccl_communicator: the NCCL library this process loaded is 2.7.8, older than 2.18.0, the oldest "
        "meshlib supports (it calls ncclCommSplit, new in 2.18; meshlib was compiled against NCCL 2.28.9 headers); "
        "install a newer NCCL (pip install -U nvidia-nccl-cu13, or your CUDA toolkit's NCCL) and make sure its "
        "libnccl.so.2 is the one loaded (LD_LIBRARY_PATH)");
}

// ---- the request state machine over a fake stream -----------------------------------------------

namespace {
// A stream whose event completes (or fails) after a scripted number of polls, recording what the
// request did to it.
struct fake_stream {
  using event_type = int;
  int polls_until_done = 0;  // < 0: never completes
  std::string fail_with;     // non-empty: the poll after polls_until_done reports this failure
  bool fail_is_peer = true;
  int polls = 0;
  std::vector<int> released;
  std::vector<std::pair<std::string, bool>> aborts;

  ml::stream_poll poll(int) {
    ++polls;
    if (polls_until_done < 0 || polls <= polls_until_done) return ml::stream_poll::pending();
    if (!fail_with.empty()) return ml::stream_poll::failed(fail_with, fail_is_peer);
    return ml::stream_poll::complete();
  }
  void abort(const std::string& reason, bool timed_out) { aborts.emplace_back(reason, timed_out); }
  void release(int e) { released.push_back(e); }
  std::string describe(std::string_view op) const { return std::string(op) + " on fake rank 0 of 2"; }
  long long timeout_ms() const { return 1; }
};
using fake_request = ml::basic_stream_request<fake_stream>;
static_assert(ml::comm_request<fake_request>);
static_assert(ml::comm_request<ml::nccl_request>);
}  // namespace

TEST_CASE("stream request: pending until its event completes, then complete for good", "[nccl][request]") {
  auto s = std::make_shared<fake_stream>();
  s->polls_until_done = 2;
  fake_request r(s, 7, "all_reduce", std::chrono::hours(1));
  CHECK(r.pending());
  CHECK_FALSE(r.test());
  CHECK_FALSE(r.test());
  CHECK(s->released.empty());  // the event is still in use
  CHECK(r.test());
  CHECK(s->released == std::vector<int>{7});  // given back exactly once, on completion
  CHECK(r.test());
  r.wait();
  CHECK(s->polls == 3);  // a complete request does not poll again
  CHECK(s->aborts.empty());
}

TEST_CASE("stream request: wait polls until complete", "[nccl][request]") {
  auto s = std::make_shared<fake_stream>();
  s->polls_until_done = 5;
  fake_request r(s, 1, "barrier", std::chrono::hours(1));
  r.wait();
  CHECK(s->polls == 6);
  CHECK_FALSE(r.pending());
}

TEST_CASE("stream request: an empty request is complete", "[nccl][request]") {
  fake_request r;
  CHECK(r.test());
  r.wait();
  CHECK_FALSE(r.pending());
}

TEST_CASE("stream request: a stream failure aborts the channel and throws comm_aborted, again on every wait",
          "[nccl][request]") {
  auto s = std::make_shared<fake_stream>();
  s->polls_until_done = 1;
  s->fail_with = "ncclRemoteError (remote process exited or there was a network error)";
  fake_request r(s, 3, "all_gather", std::chrono::hours(1));
  const std::string expected =
      "meshlib: all_gather on fake rank 0 of 2 failed: ncclRemoteError (remote process exited or there was a network error)";
  CHECK(message_of<ml::comm_aborted>([&] { r.wait(); }) == expected);
  REQUIRE(s->aborts.size() == 1);
  CHECK(s->aborts[0] == std::pair<std::string, bool>(expected, false));
  CHECK(s->released == std::vector<int>{3});
  const int polls = s->polls;
  CHECK(message_of<ml::comm_aborted>([&] { (void)r.test(); }) == expected);
  CHECK(message_of<ml::comm_aborted>([&] { r.wait(); }) == expected);
  CHECK(s->polls == polls);  // a failed request does not poll again
  CHECK(s->aborts.size() == 1);
}

TEST_CASE("stream request: a local CUDA failure is a comm_error, not an abort by a peer", "[nccl][request]") {
  auto s = std::make_shared<fake_stream>();
  s->fail_with = "cudaEventQuery failed: cudaErrorIllegalAddress (an illegal memory access was encountered)";
  s->fail_is_peer = false;
  fake_request r(s, 3, "reduce", std::chrono::hours(1));
  try {
    r.wait();
    FAIL("no exception");
  } catch (const ml::comm_aborted&) {
    FAIL("comm_aborted");
  } catch (const ml::comm_error& e) {
    CHECK(std::string(e.what()) == "meshlib: reduce on fake rank 0 of 2 failed: cudaEventQuery failed: "
                                   "cudaErrorIllegalAddress (an illegal memory access was encountered)");
  }
}

TEST_CASE("stream request: a deadline that passes aborts the channel and throws comm_timeout", "[nccl][request]") {
  auto s = std::make_shared<fake_stream>();
  s->polls_until_done = -1;  // never completes
  fake_request r(s, 9, "all_reduce", std::chrono::milliseconds(1));
  const std::string expected =
      "meshlib: all_reduce on fake rank 0 of 2 did not complete within the communicator's timeout (1 ms); a peer "
      "never joined, or the collectives were called in different orders (NCCL cannot tell); the communicator was aborted";
  CHECK(message_of<ml::comm_timeout>([&] { r.wait(); }) == expected);
  REQUIRE(s->aborts.size() == 1);
  CHECK(s->aborts[0].second);  // recorded as a timeout
  CHECK(s->released == std::vector<int>{9});
  CHECK(message_of<ml::comm_timeout>([&] { (void)r.test(); }) == expected);
}

TEST_CASE("stream request: no timeout means no deadline", "[nccl][request]") {
  auto s = std::make_shared<fake_stream>();
  s->polls_until_done = 20000;
  fake_request r(s, 2, "all_reduce", std::chrono::nanoseconds(0));
  r.wait();
  CHECK(s->aborts.empty());
}

TEST_CASE("stream request: moving hands over the event; destroying a pending request gives it back once",
          "[nccl][request]") {
  auto s = std::make_shared<fake_stream>();
  s->polls_until_done = -1;
  {
    fake_request a(s, 4, "send", std::chrono::hours(1));
    fake_request b(std::move(a));
    CHECK(a.test());  // NOLINT(bugprone-use-after-move): moved-from is empty, hence complete
    CHECK(b.pending());
    fake_request c;
    c = std::move(b);
    CHECK(s->released.empty());
  }
  CHECK(s->released == std::vector<int>{4});
}

// ---- the stream context ----------------------------------------------------------------------------

namespace {
struct fake_exec {  // what Kokkos::Cuda offers
  cudaStream_t s;
  cudaStream_t cuda_stream() const { return s; }
};
}  // namespace

TEST_CASE("cuda_stream_ref: unset means the communicator's stream; set from a stream or an execution space",
          "[nccl]") {
  auto* bound = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000});
  auto* other = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x2000});
  CHECK(ml::cuda_stream_ref{}.or_else(bound) == bound);
  CHECK_FALSE(ml::cuda_stream_ref{}.given());
  CHECK(ml::cuda_stream_ref(other).or_else(bound) == other);
  CHECK(ml::cuda_stream_ref(cudaStream_t{nullptr}).or_else(bound) == nullptr);  // the legacy stream, given
  CHECK(ml::cuda_stream_ref(fake_exec{other}).or_else(bound) == other);
}

// ---- argument checks, before anything touches a GPU ---------------------------------------------

namespace {
// A communicator of 4 ranks with no NCCL communicator behind it: every check runs before the first
// CUDA or NCCL call, so a wrong argument is reported here exactly as on a GPU.
ml::nccl_communicator fake_communicator(int rank, int size) {
  auto s = std::make_shared<ml::comm::detail::nccl_comm_state>();
  s->rank = rank;
  s->size = size;
  s->device = 0;
  s->options.check_pointers = false;
  return ml::nccl_communicator(std::move(s));
}
}  // namespace

TEST_CASE("nccl: argument errors come from the comm front end, before any data moves, naming the operation and the rank",
          "[nccl]") {
  auto c = fake_communicator(1, 4);
  std::vector<float> a(8), b(8), small(3);
  const std::string at = " on NCCL rank 1 of 4: ";
  auto arg = [](auto f) { return message_of<ml::comm_argument_error>(f); };
  std::span<const float> ca(a);
  CHECK(arg([&] { (void)c.all_reduce(ca, std::span(small), ml::reduce_op::sum); }) ==
        "meshlib: invalid argument to all_reduce" + at + "receive buffer holds 3 elements but 8 are needed");
  CHECK(arg([&] { (void)c.all_reduce(ca, std::span(a), ml::reduce_op::sum); }) ==
        "meshlib: invalid argument to all_reduce" + at +
            "the send and receive buffers overlap; use the in-place form (one buffer) instead");
  CHECK(arg([&] { (void)c.reduce(ca, std::span(b), ml::reduce_op::sum, 4); }) ==
        "meshlib: invalid argument to reduce" + at + "root 4 is out of range [0, 4)");
  CHECK(arg([&] { (void)c.broadcast(std::span(a), -1); }) ==
        "meshlib: invalid argument to broadcast" + at + "root -1 is out of range [0, 4)");
  CHECK(arg([&] { (void)c.broadcast(std::span<const float>(small), std::span(b), 1); }) ==
        "meshlib: invalid argument to broadcast" + at + "root's send buffer holds 3 elements but recv.size() = 8 are broadcast");
  CHECK(arg([&] { (void)c.all_gather(std::span<const float>(small), std::span(b)); }) ==
        "meshlib: invalid argument to all_gather" + at + "receive buffer holds 8 elements but 12 are needed");
  CHECK(arg([&] { (void)c.all_gather(std::span(small)); }) ==
        "meshlib: invalid argument to all_gather" + at + "buffer of 3 elements does not split into 4 equal blocks");
  CHECK(arg([&] { (void)c.reduce_scatter(std::span<const float>(small), std::span(b.data(), 2), ml::reduce_op::sum); }) ==
        "meshlib: invalid argument to reduce_scatter" + at + "send buffer holds 3 elements but size() * recv.size() = 8 are needed");
  const ml::permute_pair dup_dest[] = {{0, 1}, {2, 1}};
  CHECK(arg([&] { (void)c.ppermute(ca, std::span(b), dup_dest); }) ==
        "meshlib: invalid argument to ppermute" + at + "rank 1 is the destination of two pairs; each rank receives at most once");
  // NCCL's own limit, raised by the transport through the front end's error path.
  CHECK(arg([&] { (void)c.send(std::span(a), 2, 7); }) ==
        "meshlib: invalid argument to send" + at +
            "tag 7 given, but NCCL has no message tags; pass 0 (messages between two ranks match in order)");
  CHECK(arg([&] { (void)c.recv(std::span(a), 4); }) ==
        "meshlib: invalid argument to recv" + at + "source rank 4 is out of range [0, 4)");
  CHECK(arg([&] { (void)c.split(-2, 0); }) ==
        "meshlib: invalid argument to split" + at + "color -2 is negative; colors are >= 0");
  const std::int64_t three[] = {1, 1, 1}, counts[] = {2, 2, 2, 2};
  CHECK(arg([&] { (void)c.all_to_all_v(ca, three, three, std::span(b), counts, counts); }) ==
        "meshlib: invalid argument to all_to_all_v" + at + "send_counts and send_displs need 4 entries each, got 3 and 3");
}

TEST_CASE("nccl: a failed communicator refuses every operation with the root cause", "[nccl]") {
  auto c = fake_communicator(0, 2);
  c.abort("the trainer gave up");  // no NCCL communicator to abort here: only the state changes
  CHECK(c.failed());
  std::vector<float> a(4);
  CHECK(message_of<ml::comm_aborted>([&] { (void)c.all_reduce(std::span(a), ml::reduce_op::sum); }) ==
        "meshlib: refused all_reduce on NCCL rank 0 of 2 (GPU 0): the communicator has failed: abort on NCCL rank 0 "
        "of 2 (GPU 0): the trainer gave up");
  CHECK(message_of<ml::comm_aborted>([&] { (void)c.barrier(); }).starts_with("meshlib: refused barrier on NCCL rank 0"));
}

TEST_CASE("nccl: an empty handle and an impossible rank are errors, not crashes", "[nccl]") {
  ml::nccl_communicator empty;
  std::vector<float> a(4);
  CHECK(message_of<ml::comm_error>([&] { (void)empty.all_reduce(std::span(a), ml::reduce_op::sum); }) ==
        "meshlib: all_reduce called on an empty nccl_communicator handle (default-constructed or moved from)");
  const ncclUniqueId id{};
  CHECK(message_of<ml::comm_argument_error>([&] { ml::nccl_communicator c(id, 2, 2); }) ==
        "meshlib: nccl_communicator: rank 2 is outside a group of 2 participants; ranks are 0 <= rank < nranks and "
        "nranks >= 1");
  const int twice[] = {0, 1, 0};
  CHECK(message_of<ml::comm_argument_error>([&] { (void)ml::nccl_communicators(twice); }) ==
        "meshlib: nccl_communicators: GPU 0 is listed twice; NCCL refuses two ranks on one GPU (use one communicator "
        "per GPU, and the thread communicator between devices that share one)");
  CHECK(message_of<ml::comm_argument_error>([&] { (void)ml::nccl_communicators({}); }) ==
        "meshlib: nccl_communicators needs at least one GPU");
}

TEST_CASE("nccl: without a CUDA device, creating a communicator says why", "[nccl]") {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  (void)cudaGetLastError();
  if (rc == cudaSuccess && count > 0) {
    SUCCEED("a CUDA device is present: tests/device covers creation");
    return;
  }
  const ncclUniqueId id{};
  const std::string m = message_of<ml::comm_error>([&] { ml::nccl_communicator c(id, 1, 0); });
  CHECK(m == "meshlib: nccl_communicator: cudaGetDeviceCount failed: " + ml::comm::detail::cuda_error_text(rc));
}

// ---- the environment bootstrap -------------------------------------------------------------------

TEST_CASE("nccl::bootstrap_address: NCCL_COMM_ID, else MASTER_ADDR:MASTER_PORT+1, else an error for several processes",
          "[nccl][runtime]") {
  using ml::distributed::map_env;
  const ml::distributed::launch_info two{0, 2, 0, ml::distributed::launcher::torchrun};
  const ml::distributed::launch_info one{};
  CHECK(ml::nccl::bootstrap_address(map_env({{"NCCL_COMM_ID", "node0:6000"}, {"MASTER_ADDR", "x"}, {"MASTER_PORT", "1"}}), two) ==
        "node0:6000");
  CHECK(ml::nccl::bootstrap_address(map_env({{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}}), two) ==
        "10.0.0.1:29501");
  CHECK(ml::nccl::bootstrap_address(map_env({}), one).empty());
  CHECK(message_of<ml::distributed_error>([&] { (void)ml::nccl::bootstrap_address(map_env({}), two); }) ==
        "meshlib: nccl::connect_from_environment: 2 processes need a rendezvous address for NCCL; set "
        "NCCL_COMM_ID=host:port (process 0's host, a free port) or MASTER_ADDR and MASTER_PORT, or create the "
        "communicator through MPI (nccl_communicator_from_mpi)");
  CHECK(message_of<ml::distributed_error>([&] {
          (void)ml::nccl::bootstrap_address(map_env({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}), two);
        }) == "meshlib: MASTER_PORT='70000' is not a port in [1, 65534]");
}

// ---- several devices on one GPU ------------------------------------------------------------------

static_assert(ml::communicator<ml::shared_gpu_communicator>);

TEST_CASE("shared GPU: the reduction kernel compiles with NVRTC (no GPU needed) and has one kernel per type",
          "[nccl][shared_gpu]") {
  for (const char* arch : {"compute_80", "compute_90"}) {
    INFO(arch);
    const std::string ptx = ml::comm::detail::compile_reduce_kernels(arch);
    CHECK(ptx.find(".target sm_" + std::string(arch).substr(8)) != std::string::npos);
    for (ml::datatype t : ml::all_datatypes)
      CHECK(ptx.find(".entry " + ml::comm::detail::reduce_kernel_name(t)) != std::string::npos);
  }
  CHECK(message_of<ml::comm_error>([] { (void)ml::comm::detail::compile_reduce_kernels("compute_1"); })
            .starts_with("meshlib: compiling the device reduction kernel: nvrtcCompileProgram failed: "));
}

TEST_CASE("stream_state: buffer_problem checks pointers only when check_pointers is on, and only non-empty buffers",
          "[nccl]") {
  // Both device communicators' transports use this one check (no copy of it in either).
  ml::comm::detail::stream_state s;
  float host[4] = {};
  s.options.check_pointers = false;
  CHECK(s.buffer_problem("send", host, sizeof host).empty());
  s.options.check_pointers = true;
  CHECK(s.buffer_problem("send", host, 0).empty());
  // Without a driver CUDA knows no memory; with one, this is host memory: either way it is named.
  const std::string p = s.buffer_problem("receive", host, sizeof host);
  CHECK(p.starts_with("receive buffer is "));
  CHECK((p.find("not memory CUDA knows") != std::string::npos || p.find("host memory") != std::string::npos));
}

// The kernel's min/max are compiled for the host from the same text as the kernel's (detail/reduce_kernel.hpp):
// meshlib's float semantics (docs/comm.md, tests/conformance/conformance.hpp): NaN anywhere gives NaN,
// and -0 < +0 whichever rank holds which.
TEMPLATE_TEST_CASE("shared GPU: the kernel's min and max propagate NaN and order -0 < +0", "[nccl][shared_gpu]", float,
                   double) {
  using F = TestType;
  const F nan = std::numeric_limits<F>::quiet_NaN();
  const F inf = std::numeric_limits<F>::infinity();
  auto is_nan = [](F x) { return x != x; };
  for (F other : {F(1), F(-2), F(0), F(-0.0), inf, -inf}) {
    INFO(other);
    CHECK(is_nan(ml::comm::detail::reduce_max(nan, other)));
    CHECK(is_nan(ml::comm::detail::reduce_max(other, nan)));
    CHECK(is_nan(ml::comm::detail::reduce_min(nan, other)));
    CHECK(is_nan(ml::comm::detail::reduce_min(other, nan)));
  }
  const F pz = F(0);
  const F nz = F(-0.0);
  for (auto [a, b] : {std::pair{pz, nz}, std::pair{nz, pz}}) {
    CHECK(!std::signbit(ml::comm::detail::reduce_max(a, b)));
    CHECK(std::signbit(ml::comm::detail::reduce_min(a, b)));
  }
  CHECK(!std::signbit(ml::comm::detail::reduce_max(pz, pz)));
  CHECK(!std::signbit(ml::comm::detail::reduce_min(pz, pz)));
  CHECK(std::signbit(ml::comm::detail::reduce_max(nz, nz)));
  CHECK(std::signbit(ml::comm::detail::reduce_min(nz, nz)));
  CHECK(ml::comm::detail::reduce_max(F(-3), inf) == inf);
  CHECK(ml::comm::detail::reduce_min(F(-3), inf) == F(-3));
  CHECK(ml::comm::detail::reduce_max(-inf, F(2)) == F(2));
  CHECK(ml::comm::detail::reduce_min(-inf, F(2)) == -inf);
  CHECK(ml::comm::detail::reduce_max(F(5), F(5)) == F(5));
  CHECK(ml::comm::detail::reduce_min(F(-5), F(-5)) == F(-5));
}

TEST_CASE("shared GPU: the kernel's min and max on integers are the plain order", "[nccl][shared_gpu]") {
  CHECK(ml::comm::detail::reduce_max(-7, 3) == 3);
  CHECK(ml::comm::detail::reduce_min(-7, 3) == -7);
  CHECK(ml::comm::detail::reduce_max(0, 0) == 0);
  CHECK(ml::comm::detail::reduce_min(std::int64_t{-1}, std::int64_t{0}) == -1);
  CHECK(ml::comm::detail::reduce_max(std::numeric_limits<std::int64_t>::min(), std::int64_t{0}) == 0);
}

TEST_CASE("shared GPU: the kernel source reduces min and max with the host-tested functions", "[nccl][shared_gpu]") {
  // The text NVRTC compiles holds the same definitions (the kernel test above compiles it).
  const std::string minmax(ml::comm::detail::reduce_minmax_source);
  CHECK(minmax.find("meshlib_device_function V reduce_max(V a, V b)") != std::string::npos);
  CHECK(minmax.find("meshlib_device_function V reduce_min(V a, V b)") != std::string::npos);
  CHECK(minmax.find("if (a == b) return a == V(0) ? -(-a - b) : a;") != std::string::npos);
  const std::string kernel(ml::comm::detail::reduce_kernel_source);
  CHECK(kernel.find("case 2: a = reduce_min(a, b); break;") != std::string::npos);
  CHECK(kernel.find("default: a = reduce_max(a, b); break;") != std::string::npos);
}

TEST_CASE("shared GPU: argument errors come from the same front end as NCCL's, naming the shared-GPU device",
          "[nccl][shared_gpu]") {
  ml::thread_world world(4);
  auto s = std::make_shared<ml::comm::detail::shared_gpu_state>();
  s->host = world.communicator(1);
  s->options.check_pointers = false;
  ml::shared_gpu_communicator c(std::move(s));  // no stream, no events: every check runs before CUDA
  std::vector<float> a(8), b(8), small(3);
  auto arg = [](auto f) { return message_of<ml::comm_argument_error>(f); };
  const std::string at = " on shared-GPU device 1 of 4: ";
  CHECK(arg([&] { (void)c.all_gather(std::span<const float>(small), std::span(b)); }) ==
        "meshlib: invalid argument to all_gather" + at + "receive buffer holds 8 elements but 12 are needed");
  CHECK(arg([&] { (void)c.reduce(std::span<const float>(a), std::span(b), ml::reduce_op::sum, 7); }) ==
        "meshlib: invalid argument to reduce" + at + "root 7 is out of range [0, 4)");
  CHECK(arg([&] { (void)c.reduce_scatter(std::span<const float>(small), std::span(b.data(), 2), ml::reduce_op::sum); }) ==
        "meshlib: invalid argument to reduce_scatter" + at + "send buffer holds 3 elements but size() * recv.size() = 8 are needed");
  CHECK(arg([&] { (void)c.split(-1, 0); }) == "meshlib: invalid argument to split" + at + "color -1 is negative; colors are >= 0");
  // Word for word the NCCL communicator's (one front end), but for the participant's label.
  auto nccl = fake_communicator(1, 4);
  const ml::permute_pair dup[] = {{0, 1}, {0, 2}};
  std::string theirs = arg([&] { (void)nccl.ppermute(std::span(a), dup); });
  theirs.replace(theirs.find("NCCL rank 1"), 11, "shared-GPU device 1");
  CHECK(arg([&] { (void)c.ppermute(std::span(a), dup); }) == theirs);
  CHECK(message_of<ml::comm_argument_error>([] { ml::run_on_shared_gpu(33, [](ml::shared_gpu_communicator&) {}, {.device = 0}); })
            == "meshlib: run_on_shared_gpu: 33 devices on one GPU; at most 32 are supported");
}

// ---- the shared-GPU devices' events: alive until every peer has waited on them ----------------------

namespace {
// A fake event: a heap int the registry knows while it exists. A wait on an event the registry does
// not know is a wait on a destroyed event (on a GPU: cudaStreamWaitEvent on a freed handle, the
// SIGSEGV of issue 36's 4-device conformance run).
struct fake_events {
  std::mutex mutex;
  std::set<const int*> live;
  int created = 0;
  int dead_waits = 0;
  int wrong_device = 0;  // destroyed with another device than it was made for
  int* make() {
    auto* e = new int(1);
    std::lock_guard g(mutex);
    live.insert(e);
    ++created;
    return e;
  }
  void wait(const int* e) {
    std::this_thread::yield();  // as a real cudaStreamWaitEvent, it takes a while: the owner may leave meanwhile
    std::lock_guard g(mutex);
    if (live.count(e) == 0) ++dead_waits;
  }
};
fake_events* the_fake_events = nullptr;
struct fake_event_traits {
  using event_type = int*;
  static void destroy(int* e, int device) noexcept {  // on any thread: no Catch2 assertion here
    {
      std::lock_guard g(the_fake_events->mutex);
      the_fake_events->live.erase(e);
      if (device != 7) ++the_fake_events->wrong_device;
    }
    delete e;
  }
};
using fake_shared_event = ml::comm::detail::basic_shared_event<fake_event_traits>;
}  // namespace

TEST_CASE("shared GPU: a device's events outlive it until every peer has waited on them (stress, 4 devices)",
          "[nccl][shared_gpu][repeat]") {
  // The protocol of shared_gpu_communicator's arrive and depart, on the host communicator it uses:
  // publish the event's handle in an all_gather, then each peer waits on it, and the owner returns
  // (and is destroyed) as soon as its own all_gather is over. Destroying the event with its owner
  // made a slower peer wait on a destroyed event; shared, it lives until the last peer is done.
  fake_events events;
  the_fake_events = &events;
  constexpr int devices = 4;
  constexpr int rounds = 300;
  for (int round = 0; round < rounds; ++round) {
    const int ops = 1 + round % 3;
    const bool fails = round % 10 == 9;  // the last device throws after the rendezvous (a mismatch, a CUDA error)
    try {
      ml::run_on_threads(devices, [&](ml::thread_communicator& host) {
        fake_shared_event* mine = fake_shared_event::adopt(events.make(), 7);
        struct owner {
          fake_shared_event* e;
          ~owner() { e->release(); }  // the device's state goes with its thread
        } keep{mine};
        for (int op = 0; op < ops; ++op) {
          std::vector<std::int64_t> all(devices);
          mine->share(devices - 1);
          const std::int64_t handle = mine->handle();
          host.all_gather(std::span<const std::int64_t>(&handle, 1), std::span<std::int64_t>(all));
          ml::comm::detail::peer_event_refs<fake_event_traits> peers(devices, host.rank(),
                                                               [&](int q) { return all[static_cast<std::size_t>(q)]; });
          if (fails && op + 1 == ops && host.rank() == devices - 1) throw std::runtime_error("device failed");
          for (int q = 0; q < devices; ++q)
            if (q != host.rank()) events.wait(peers[q]);
        }
      });
      CHECK_FALSE(fails);
    } catch (const ml::participant_error&) {
      CHECK(fails);
    }
  }
  CHECK(events.dead_waits == 0);
  CHECK(events.live.empty());  // every event destroyed once its last holder gave it back, failures included
  CHECK(events.created == devices * rounds);
  CHECK(events.wrong_device == 0);
  the_fake_events = nullptr;
}

TEST_CASE("shared GPU: a shared event is destroyed by its last reference, on whichever side that is", "[nccl][shared_gpu]") {
  fake_events events;
  the_fake_events = &events;
  auto* e = fake_shared_event::adopt(events.make(), 7);
  CHECK(fake_shared_event::from_handle(e->handle()) == e);
  e->share(2);
  e->release();  // the owner leaves first
  CHECK(events.live.size() == 1);
  {
    const std::int64_t handles[] = {e->handle(), 0, e->handle()};  // rank 1 is "self": its own slot is not taken
    ml::comm::detail::peer_event_refs<fake_event_traits> peers(3, 1, [&](int q) { return handles[q]; });
    CHECK(peers[0] == peers[2]);
    events.wait(peers[0]);
  }  // both references given back by the holder's destruction: the event goes
  CHECK(events.live.empty());
  CHECK(events.dead_waits == 0);
  the_fake_events = nullptr;
}

TEST_CASE("shared GPU: an in-place all_to_all or ppermute of nothing makes no scratch copy, so frees nothing of the caller's",
          "[nccl][shared_gpu]") {
  // The communicator frees whatever in_place_scratch returns. For an empty buffer it returned the
  // caller's own pointer, which cudaFreeAsync then freed, and the caller's cudaFree freed a
  // second time (the conformance rows' in-place all_to_all and ppermute with count 0).
  std::vector<char> scratch(64);
  int allocations = 0;
  int copies = 0;
  std::size_t asked = 0;
  auto allocate = [&](std::size_t bytes) {
    ++allocations;
    asked = bytes;
    return static_cast<void*>(scratch.data());
  };
  auto copy = [&](void* p) {
    ++copies;
    CHECK(p == scratch.data());
  };
  CHECK(ml::comm::detail::in_place_scratch(0, allocate, copy) == nullptr);  // nothing moves: nothing to free
  CHECK(allocations == 0);
  CHECK(copies == 0);
  CHECK(ml::comm::detail::in_place_scratch(48, allocate, copy) == scratch.data());  // the copy, which the caller frees
  CHECK(allocations == 1);
  CHECK(copies == 1);
  CHECK(asked == 48);
}

// ---- the call fingerprint of verify_collectives -------------------------------------------------------

TEST_CASE("call fingerprint: packing is lossless for every operation, type, op and root", "[nccl][fingerprint]") {
  using ml::comm::detail::call_fingerprint;
  using ml::comm::detail::op_kind;
  std::vector<std::int64_t> seen;
  for (int op = 0; op <= static_cast<int>(op_kind::recv); ++op)
    for (int type = -1; type <= 4; ++type)
      for (int red = -1; red <= 4; ++red)
        for (int root : {-1, 0, 1, 4095, 65534})
          for (std::uint64_t count : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{19}, (std::uint64_t{1} << 36) - 1}) {
            call_fingerprint f{static_cast<op_kind>(op), type, red, root, count};
            const auto back = call_fingerprint::unpack(f.pack());
            REQUIRE(back.op == f.op);
            REQUIRE(back.type == type);
            REQUIRE(back.reduce == red);
            REQUIRE(back.root == root);
            REQUIRE(back.count == count);
            seen.push_back(f.pack());
          }
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());  // distinct calls, distinct fingerprints
}

TEST_CASE("call fingerprint: agreeing calls give no message; disagreeing ones list every rank's call", "[nccl][fingerprint]") {
  using ml::comm::detail::call_fingerprint;
  using ml::comm::detail::op_kind;
  const auto a = call_fingerprint{op_kind::all_reduce, 0, 0, -1, 8}.pack();
  const auto b = call_fingerprint{op_kind::all_gather, 0, -1, -1, 4}.pack();
  const auto c = call_fingerprint{op_kind::broadcast, 3, -1, 1, 3}.pack();
  const auto d = call_fingerprint{}.pack();
  const std::int64_t same[] = {a, a, a};
  CHECK(ml::comm::detail::mismatch_message("NCCL rank 0 of 3, GPU 0", same).empty());
  const std::int64_t differ[] = {a, b, c, d};
  CHECK(ml::comm::detail::mismatch_message("NCCL rank 2 of 4, GPU 2", differ) ==
        "meshlib: collective mismatch (seen by NCCL rank 2 of 4, GPU 2): rank 0 called all_reduce(float32, count 8, "
        "op sum); rank 1 called all_gather(float32, count 4); rank 2 called broadcast(int64, count 3, root 1); rank 3 "
        "called barrier()");
}

TEST_CASE("stream request: a mismatch reported by the channel is a collective_mismatch with its message", "[nccl][request]") {
  struct mismatch_stream : fake_stream {
    ml::stream_poll poll(int) { return ml::stream_poll::mismatched("meshlib: collective mismatch (seen by x): rank 0 called barrier()"); }
  };
  auto s = std::make_shared<mismatch_stream>();
  ml::basic_stream_request<mismatch_stream> r(s, 1, "barrier", std::chrono::hours(1));
  CHECK(message_of<ml::collective_mismatch>([&] { r.wait(); }) ==
        "meshlib: collective mismatch (seen by x): rank 0 called barrier()");
  REQUIRE(s->aborts.size() == 1);  // the mismatched collective may never finish: the channel is aborted
  CHECK(message_of<ml::collective_mismatch>([&] { r.wait(); }) ==
        "meshlib: collective mismatch (seen by x): rank 0 called barrier()");
}

// ---- the batched schedule of the default-on check (issue 40 §3) -----------------------------------

TEST_CASE("call batch: each of the first calls is exchanged alone, then every N; the schedule depends only on the count",
          "[nccl][fingerprint]") {
  using ml::comm::detail::call_batch;
  for (std::size_t every : {1u, 2u, 5u, 16u})
    for (std::size_t first : {0u, 3u, 64u}) {
      INFO("every " << every << ", each_first " << first);
      call_batch b(every, first);
      std::uint64_t exchanged = 0;  // calls covered by exchanges so far
      for (std::uint64_t call = 1; call <= 200; ++call) {
        const bool now = b.add(static_cast<std::int64_t>(call));
        const bool expect = call <= first || (call - exchanged) == every;
        REQUIRE(now == expect);
        if (now) {
          // The batch is every call since the last exchange, oldest first, this one last.
          REQUIRE(b.first_pending() == exchanged + 1);
          REQUIRE(b.pending().size() == call - exchanged);
          REQUIRE(b.pending().back() == static_cast<std::int64_t>(call));
          REQUIRE(b.pending().size() <= b.every());
          exchanged = call;
          b.clear();
        }
      }
    }
  CHECK(call_batch(0, 0).every() == 1);  // 0 means every call, not never
}

TEST_CASE("call batch: the first disagreement of a gathered batch is named by its number and every rank's call",
          "[nccl][fingerprint]") {
  using ml::comm::detail::call_fingerprint;
  using ml::comm::detail::op_kind;
  const auto ar8 = call_fingerprint{op_kind::all_reduce, 0, 0, -1, 8}.pack();
  const auto ar4 = call_fingerprint{op_kind::all_reduce, 0, 0, -1, 4}.pack();
  const auto bar = call_fingerprint{}.pack();
  // Two ranks, a batch of 3 calls (numbers 17, 18, 19), rank after rank: they differ at 18 and 19.
  const std::int64_t all[] = {bar, ar8, bar, /* rank 1 */ bar, ar4, ar8};
  CHECK(ml::comm::detail::batch_mismatch_message("NCCL rank 0 of 2, GPU 0", 17, 3, all) ==
        "meshlib: collective mismatch in collective 18 on this communicator (seen by NCCL rank 0 of 2, GPU 0): rank 0 "
        "called all_reduce(float32, count 8, op sum); rank 1 called all_reduce(float32, count 4, op sum)");
  const std::int64_t same[] = {bar, ar8, bar, ar8};
  CHECK(ml::comm::detail::batch_mismatch_message("x", 1, 2, same).empty());
}

TEST_CASE("call batch: a timeout's message lists the calls this rank made since its last check", "[nccl][request]") {
  using ml::comm::detail::call_fingerprint;
  using ml::comm::detail::op_kind;
  struct batched_stream : fake_stream {
    ml::comm::detail::call_batch batch{16, 0};
    std::string unchecked_calls() const { return batch.describe_pending(); }
  };
  auto s = std::make_shared<batched_stream>();
  s->polls_until_done = -1;  // hangs, as NCCL does when the ranks disagree on a count
  const auto barrier = call_fingerprint{op_kind::barrier, -1, -1, -1, 0}.pack();
  for (int i = 0; i < 16; ++i) (void)s->batch.add(barrier);
  s->batch.clear();  // calls 1..16 were exchanged
  (void)s->batch.add(barrier);
  (void)s->batch.add(call_fingerprint{op_kind::all_reduce, 0, 0, -1, 8}.pack());
  ml::basic_stream_request<batched_stream> r(s, 5, "all_reduce", std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const std::string m = message_of<ml::comm_timeout>([&] { r.wait(); });
  CHECK(m.ends_with("the communicator was aborted; the collectives this rank made since its last mismatch check: 17 "
                    "barrier(), 18 all_reduce(float32, count 8, op sum)"));
}

TEST_CASE("nccl options: the mismatch check is on by default, batched, and the same options drive the shared GPU",
          "[nccl][fingerprint]") {
  const ml::nccl_comm_options o;
  CHECK(o.verify_collectives);
  CHECK(o.verify_every == 16);
  CHECK(o.verify_each_first == 64);
}
