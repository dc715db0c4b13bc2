#pragma once
/// @file
/// @brief The comm layer: the communicator concept, reduce ops, datatypes, errors, and the
/// always-built thread communicator. Depends on core only.
