// The nanobind bindings of data/: plain functions of the extension (host-side construction, not
// FFI targets), added to the module by module.cc.
#pragma once
#include <nanobind/nanobind.h>

namespace jaxdata::data {

void AddGraphBuildFunctions(nanobind::module_& m);

}  // namespace jaxdata::data
