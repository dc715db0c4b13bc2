// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The typed layer's handle on a stream backend (collectives/device_context.hpp), on the host: a
// fake communicator whose requests complete when a scripted "stream" says so stands in for NCCL.
// An operation is enqueued and not waited for (its request is polled once, never waited, when the
// next is enqueued); synchronize() waits for the last one and throws its error; a failure of an
// earlier operation surfaces right after the next enqueue. A host backend (the thread communicator) still
// completes every operation in the call. And which contexts take device memory.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "meshlib/collectives.hpp"
#include "meshlib/comm.hpp"
#include "meshlib/comm/nccl/stream_request.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace ml = meshlib;

namespace {

// The "GPU": events complete once `done` is set; `fail_with` makes them fail instead.
struct scripted_stream {
  using event_type = int;
  bool done = false;
  std::string fail_with;
  int polls = 0;
  int next_event = 0;
  ml::stream_poll poll(int) {
    ++polls;
    if (!fail_with.empty()) return ml::stream_poll::failed(fail_with);
    return done ? ml::stream_poll::complete() : ml::stream_poll::pending();
  }
  void abort(const std::string&, bool) {}
  void release(int) {}
  std::string describe(std::string_view op) const { return std::string(op) + " on fake stream rank 0 of 1"; }
  long long timeout_ms() const { return 60000; }
};

struct fake_stream_context {};  // not host_context: a stream backend

// A one-rank communicator whose every operation copies send to recv at once (the "kernel") and
// returns a request pending on the scripted stream.
class stream_comm
    : public ml::communicator_frontend<stream_comm, ml::basic_stream_request<scripted_stream>, fake_stream_context> {
  friend class ml::communicator_frontend<stream_comm, ml::basic_stream_request<scripted_stream>, fake_stream_context>;

 public:
  explicit stream_comm(std::shared_ptr<scripted_stream> s) : stream_(std::move(s)) {}
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
  stream_comm split(int color, int) {
    check_split(color);
    return *this;
  }
  std::vector<std::string> ops;

 private:
  std::shared_ptr<scripted_stream> stream_;
  void ensure_usable(ml::comm::detail::op_kind) const {}
  std::string label() const { return "fake stream rank 0"; }
  template <ml::comm::detail::op_kind K, class T>
  request_type transport(const ml::comm::detail::operation<T>& o, fake_stream_context) {
    ops.emplace_back(ml::comm::detail::op_name(K));
    if (o.send != nullptr && o.recv != nullptr && o.send != o.recv)
      for (std::size_t i = 0; i < o.count; ++i) o.recv[i] = o.send[i];
    return request_type(stream_, stream_->next_event++, std::string(ml::comm::detail::op_name(K)), std::chrono::hours(1));
  }
};
static_assert(ml::communicator<stream_comm>);
static_assert(ml::collectives::detail::stream_ordered_v<stream_comm>);
static_assert(!ml::collectives::detail::stream_ordered_v<ml::thread_communicator>);

}  // namespace

TEST_CASE("stream backend handle: operations are enqueued, not waited for; synchronize waits for the last") {
  auto s = std::make_shared<scripted_stream>();
  stream_comm c(s);
  ml::collectives::detail::device_comm_for<stream_comm> h(c);
  const float in[3] = {1, 2, 3};
  float out[3] = {};
  h.all_reduce(in, out, 3, ml::datatype::float32, ml::reduce_op::sum);  // the stream never finishes yet
  CHECK(s->polls == 0);                                                // not even polled
  CHECK(out[2] == 3);
  float out2[3] = {};
  h.all_gather(in, out2, 3, ml::datatype::float32);
  CHECK(s->polls == 1);  // the previous request polled once (pending), never waited for
  CHECK(c.ops == std::vector<std::string>{"all_reduce", "all_gather"});
  s->done = true;
  h.synchronize();  // waits for the last: complete now
  CHECK(s->polls == 2);
  h.synchronize();  // nothing pending any more
  CHECK(s->polls == 2);
}

TEST_CASE("stream backend handle: a failed operation is reported at the next enqueue or at synchronize") {
  auto s = std::make_shared<scripted_stream>();
  stream_comm c(s);
  ml::collectives::detail::device_comm_for<stream_comm> h(c);
  float buf[2] = {1, 2};
  h.all_reduce(buf, 2, ml::datatype::float32, ml::reduce_op::sum);
  s->fail_with = "unhandled cuda error";
  CHECK(meshlib_test::message_of<ml::comm_aborted>([&] { h.broadcast(buf, 2, ml::datatype::float32, 0); }) ==
        "meshlib: all_reduce on fake stream rank 0 of 1 failed: unhandled cuda error");
  // The broadcast's request was made (a poll of the earlier one comes after the enqueue, and the
  // failure aborted the communicator, which refuses or cancels what follows); the failed request is
  // kept and reported again.
  CHECK(c.ops == std::vector<std::string>{"all_reduce", "broadcast"});
  CHECK_THROWS_AS(h.synchronize(), ml::comm_aborted);

  auto s2 = std::make_shared<scripted_stream>();
  stream_comm c2(s2);
  ml::collectives::detail::device_comm_for<stream_comm> h2(c2);
  h2.all_to_all(buf, buf + 1, 1, ml::datatype::float32);
  s2->fail_with = "peer gone";
  CHECK(meshlib_test::message_of<ml::comm_aborted>([&] { h2.synchronize(); }) ==
        "meshlib: all_to_all on fake stream rank 0 of 1 failed: peer gone");
}

TEST_CASE("device contexts: a stream backend takes device memory, a host backend does not") {
  using mesh1 = ml::mesh<ml::axis<"x">>;
  const mesh1 m{1};
  auto s = std::make_shared<scripted_stream>();
  s->done = true;
  ml::collectives::detail::device_context_for<stream_comm, mesh1> gpu_like(m, 0, stream_comm(s));
  CHECK(gpu_like.takes_device_memory());
  float buf[2] = {1, 2};
  gpu_like.comm(1).all_reduce(buf, 2, ml::datatype::float32, ml::reduce_op::sum);
  gpu_like.synchronize();  // drains the worker and waits for the handles' last operations
  CHECK(s->polls >= 1);
  ml::thread_world world(1);
  ml::collectives::detail::device_context_for<ml::thread_communicator, mesh1> host(m, 0, world.communicator(0));
  CHECK_FALSE(host.takes_device_memory());
  host.comm(1).all_reduce(buf, 2, ml::datatype::float32, ml::reduce_op::sum);  // completes in the call
  host.synchronize();                                                           // nothing to wait for
  CHECK(buf[1] == 2);
}

}  // namespace MESHLIB_TEST_UNIT
