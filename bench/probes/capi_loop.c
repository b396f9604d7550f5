// The native side of bench/probes/capi_post.py: NIXL transfers posted and polled from C through
// the nixl wheels' C API (libnixl_capi.so), with no Python between the calls. Built by the probe
// itself (cc -O2 -shared -fPIC) and given the C API's entry points as addresses, so it needs no
// NIXL header and links nothing: an experiment stays out of the shipped extension.
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "../../csrc/nixl_capi_fns.h"



static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

// Times n transfers of `per_op` descriptors each; operation i uses idx[(i % ring) * per_op ...].
// remake != 0: each operation makes, posts, polls and releases its own request (ec-nixl's way);
// remake == 0: reqs[i % ring] were made beforehand and are posted again. out_us[i]: post (or
// make) -> final status. Returns 0, or the failing call's status (negative), or 2 on a timeout.
int capi_time_ops(void *const fns[5], void *agent, int op, void *local, void *remote, const int *idx,
                  size_t per_op, size_t ring, int n, int remake, void **reqs, double timeout_us,
                  double *out_us) {
  make_fn make = (make_fn)fns[0];
  post_fn post = (post_fn)fns[1];
  status_fn status = (status_fn)fns[2];
  release_fn release = (release_fn)fns[3];
  destroy_fn destroy = (destroy_fn)fns[4];
  for (int i = 0; i < n; i++) {
    const int *at = idx + (i % ring) * per_op;
    void *req = remake ? NULL : reqs[i % ring];
    double t0 = now_us();
    int st;
    if (remake && (st = make(agent, op, local, at, per_op, remote, at, per_op, &req, NULL)) != CAPI_SUCCESS)
      return st < 0 ? st : -100;
    st = post(agent, req, NULL);
    while (st == CAPI_IN_PROG) {
      st = status(agent, req);
      if (now_us() - t0 > timeout_us) return 2;
    }
    out_us[i] = now_us() - t0;
    if (st != CAPI_SUCCESS) return st < 0 ? st : -101;
    if (remake) {
      release(agent, req);
      destroy(req);
    }
  }
  return 0;
}
