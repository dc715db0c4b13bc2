// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `axis_communicators`: for one device of a `mesh`, the communicator of its group along
/// any set of mesh axes, split from the communicator of the whole mesh, with ranks in the group's
/// stable order (`mesh::group`, `mesh::group_rank`). Works with every backend (it only needs
/// `split`) and builds each group's communicator once, on first use.

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"

namespace meshlib {

/// @brief The communicators of one device's groups along the axes of a mesh.
///
/// The device is the rank of `world`, whose size must be the mesh's. `over<"data">()` is the
/// communicator of the devices that differ from this one only in axis "data", ranked by their
/// "data" coordinate; `over<"data", "model">()` (any subset, in any order) that of the group along
/// both axes, ranked row-major over them. Its rank is `mesh.group_rank(device, mask)`.
///
/// The first call for a set of axes is collective over `world` (it splits it): every device must
/// ask for the same sets of axes in the same order, as SPMD code does naturally (a device that
/// asks for another set meets a `collective_mismatch`, not a hang). Later calls return the cached
/// communicator at the cost of a map lookup. The whole mesh (every axis) is `world` itself.
/// @code
/// meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">> m{2, 2};
/// meshlib::run_on_threads(4, [&](meshlib::thread_communicator& world) {
///   meshlib::axis_communicators axes(world, m);
///   auto& model = axes.over<"model">();   // devices {0,1} or {2,3}
///   float x = 1.0f;
///   model.all_reduce(std::span(&x, 1), meshlib::reduce_op::sum);  // x == 2
/// });
/// @endcode
template <communicator Comm, mesh_type Mesh>
class axis_communicators {
 public:
  /// @throws comm_argument_error when world.size() differs from mesh.size().
  axis_communicators(Comm& world, const Mesh& mesh) : world_(&world), mesh_(mesh) {
    if (static_cast<std::size_t>(world.size()) != mesh.size())
      throw comm_argument_error("meshlib: axis_communicators: the communicator has " + std::to_string(world.size()) +
                                " ranks but mesh " + mesh.to_string() + " has " + std::to_string(mesh.size()) +
                                " devices; build it from the communicator of the whole mesh");
  }

  /// The device this object belongs to (its rank in the whole-mesh communicator).
  [[nodiscard]] std::size_t device() const noexcept { return static_cast<std::size_t>(world_->rank()); }
  /// The mesh whose axes the communicators span.
  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }

  /// @brief The communicator of this device's group along the axes in `mask`.
  Comm& over(axis_mask mask) {
    mask &= Mesh::all_axes;
    // A group that holds every device (the whole mesh, or axes whose complement has size 1) is
    // `world` itself, in the same rank order: no split (an NCCL split costs as much as a new
    // communicator, and a 1-device mesh asks for its data group every step).
    if (mask == Mesh::all_axes || mesh_.axes_size(mask) == mesh_.size()) return *world_;
    auto it = groups_.find(mask);
    if (it == groups_.end()) {
      const std::size_t dev = device();
      Comm sub = world_->split(static_cast<int>(mesh_.group_color(dev, mask)), static_cast<int>(mesh_.group_rank(dev, mask)));
      it = groups_.emplace(mask, std::make_unique<Comm>(std::move(sub))).first;
    }
    return *it->second;
  }

  /// @brief The communicator of this device's group along the axes named `Names...`.
  template <fixed_string... Names>
  Comm& over() {
    return over(Mesh::template mask_of<Names...>());
  }

 private:
  Comm* world_;
  Mesh mesh_;
  std::map<axis_mask, std::unique_ptr<Comm>> groups_;
};

}  // namespace meshlib
