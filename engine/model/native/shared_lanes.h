// lanes.h inside mtpserve itself, once a translation unit: the 16-float vector and the dot
// products built from it for the module's own code (norms, exp, attention, the sampler),
// compiled with the module's flags. Each instruction set's kernel file includes lanes.h inside
// its own namespace instead.
#pragma once

#include <cstdint>

namespace mtpserve {

#include "lanes.h"

}  // namespace mtpserve
