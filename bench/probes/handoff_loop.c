// The native side of bench/probes/handoff_floor.py, design (a): a pthread inside the publishing
// process that sees a publish, waits for its copy (a CUDA event, when there is one), makes and
// posts a NIXL WRITE with a notification through the nixl wheel's C API (libnixl_capi.so) and
// polls it to completion, without ever taking the interpreter's lock. Python only starts it and
// publishes (one atomic store, a futex wake when the thread sleeps). Built by the probe with the
// system C compiler; given the C API's and the CUDA driver's entry points as addresses, so it
// needs no header and links nothing beyond pthreads.
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../../csrc/nixl_capi_fns.h"


enum { CU_NOT_READY = 600, WRITE = 1 };

typedef struct {
  void *fns[6];  // make, post, status, release, destroy, set_notif_msg
  void *agent, *local, *remote, *opt;
  const int *slot;  // slot of operation i: slot[i % ring]
  int ring;
  ev_query_fn ev_query;
  void *event;  // the publisher's CUDA event (recorded after its copy), or NULL
  ctx_set_fn ctx_set;
  void *ctx;
  double spin_us;  // spin this long for the next publish while armed, then sleep on the futex
  int n;           // capacity of the stamp arrays
  double *t_seen, *t_posted, *t_done;
  int *result;
  _Atomic uint32_t seq;       // the last publish (0: none yet)
  _Atomic uint32_t sleeping;  // the thread is (about to be) in futex_wait
  _Atomic uint32_t armed;     // work is expected: spin before sleeping
  _Atomic uint32_t stop;
  _Atomic uint32_t handled;   // the last publish the thread finished
  pthread_t thread;
} handoff_loop;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void cpu_relax(void) { __builtin_ia32_pause(); }

static uint32_t wait_publish(handoff_loop *l, uint32_t last) {
  uint32_t s;
  if (atomic_load(&l->armed) && l->spin_us > 0) {
    double until = now_s() + l->spin_us * 1e-6;
    while ((s = atomic_load(&l->seq)) == last && !atomic_load(&l->stop)) {
      if (now_s() > until) break;
      cpu_relax();
    }
    if (s != last) return s;
  }
  while ((s = atomic_load(&l->seq)) == last && !atomic_load(&l->stop)) {
    atomic_store(&l->sleeping, 1);
    syscall(SYS_futex, &l->seq, FUTEX_WAIT_PRIVATE, last, NULL, NULL, 0);
    atomic_store(&l->sleeping, 0);
  }
  return s;
}

static void *run(void *arg) {
  handoff_loop *l = (handoff_loop *)arg;
  make_fn make = (make_fn)l->fns[0];
  post_fn post = (post_fn)l->fns[1];
  status_fn status = (status_fn)l->fns[2];
  release_fn release = (release_fn)l->fns[3];
  destroy_fn destroy = (destroy_fn)l->fns[4];
  opt_msg_fn set_msg = (opt_msg_fn)l->fns[5];
  if (l->ctx_set && l->ctx) l->ctx_set(l->ctx);
  uint32_t last = 0;
  for (;;) {
    uint32_t s = wait_publish(l, last);
    if (atomic_load(&l->stop)) break;
    last = s;
    int i = (int)(s % (uint32_t)l->n);
    l->t_seen[i] = now_s();
    if (l->event) {
      int q;
      while ((q = l->ev_query(l->event)) == CU_NOT_READY) cpu_relax();
      if (q != 0) { l->result[i] = -1000 - q; atomic_store(&l->handled, s); continue; }
    }
    char msg[16];
    int len = snprintf(msg, sizeof msg, "%u", s);
    const int *at = l->slot + (s % (uint32_t)l->ring);
    void *req = NULL;
    int st = set_msg(l->opt, msg, (size_t)len);
    if (st == CAPI_SUCCESS) st = make(l->agent, WRITE, l->local, at, 1, l->remote, at, 1, &req, l->opt);
    if (st == CAPI_SUCCESS) {
      st = post(l->agent, req, NULL);
      l->t_posted[i] = now_s();
      while (st == CAPI_IN_PROG) st = status(l->agent, req);
      l->t_done[i] = now_s();
      release(l->agent, req);
      destroy(req);
    }
    l->result[i] = st;
    atomic_store(&l->handled, s);
  }
  return NULL;
}

// A loop over prepped lists `local`/`remote` (slot k of operation s: slot[s % ring], both sides),
// started at once; NULL if the thread cannot start. The stamp arrays hold n operations (by s % n).
handoff_loop *handoff_loop_start(void *const fns[6], void *agent, void *local, void *remote, void *opt,
                                 const int *slot, int ring, void *ev_query, void *event, void *ctx_set,
                                 void *ctx, double spin_us, int n, double *t_seen, double *t_posted,
                                 double *t_done, int *result) {
  handoff_loop *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  memcpy(l->fns, fns, sizeof l->fns);
  l->agent = agent, l->local = local, l->remote = remote, l->opt = opt, l->slot = slot, l->ring = ring;
  l->ev_query = (ev_query_fn)ev_query, l->event = event, l->ctx_set = (ctx_set_fn)ctx_set, l->ctx = ctx;
  l->spin_us = spin_us, l->n = n;
  l->t_seen = t_seen, l->t_posted = t_posted, l->t_done = t_done, l->result = result;
  if (pthread_create(&l->thread, NULL, run, l) != 0) {
    free(l);
    return NULL;
  }
  return l;
}

void handoff_loop_set_event(handoff_loop *l, void *event) { l->event = event; }

// The publisher's whole signal: one store, and a wake only when the thread sleeps.
void handoff_loop_publish(handoff_loop *l, uint32_t s) {
  atomic_store(&l->seq, s);
  if (atomic_load(&l->sleeping)) syscall(SYS_futex, &l->seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

void handoff_loop_arm(handoff_loop *l, uint32_t on) { atomic_store(&l->armed, on); }

uint32_t handoff_loop_handled(handoff_loop *l) { return atomic_load(&l->handled); }

void handoff_loop_stop(handoff_loop *l) {
  atomic_store(&l->stop, 1);
  atomic_fetch_add(&l->seq, 0x80000000u);
  syscall(SYS_futex, &l->seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
  pthread_join(l->thread, NULL);
  free(l);
}
