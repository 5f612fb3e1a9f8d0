// Names the calling thread (Linux: at most 15 characters), so that tools and leak tests can tell
// jaxdata's own threads ("jaxdata-...") from the runtime's.
#pragma once
#include <pthread.h>

namespace jaxdata {

inline void NameThisThread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace jaxdata
