// The entry points of the nixl wheel's C API (libnixl_capi.so, nixl 1.5.1) that ec-nixl's native
// code calls, as function-pointer types: callers are given their addresses (ctypes resolves them
// from the library the bindings loaded), so nothing here needs NIXL's headers or links libnixl.
// Shared by csrc/handoff.cpp and the probes in bench/probes/ (valid C and C++).
#ifndef EC_NIXL_CAPI_FNS_H
#define EC_NIXL_CAPI_FNS_H
#include <stddef.h>

typedef int (*make_fn)(void *agent, int op, void *local, const int *li, size_t nl, void *remote,
                       const int *ri, size_t nr, void **req, void *opt);
typedef int (*post_fn)(void *agent, void *req, void *opt);
typedef int (*status_fn)(void *agent, void *req);
typedef int (*release_fn)(void *agent, void *req);
typedef int (*destroy_fn)(void *req);
typedef int (*opt_msg_fn)(void *opt, const void *data, size_t len);  // nixl_capi_opt_args_set_notif_msg
typedef int (*ev_query_fn)(void *event);  // the CUDA driver's cuEventQuery: 0 done, 600 not ready
typedef int (*ctx_set_fn)(void *ctx);    // the CUDA driver's cuCtxSetCurrent

enum { CAPI_SUCCESS = 0, CAPI_IN_PROG = 1 };

#endif
