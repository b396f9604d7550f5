// ec-nixl's native hand-off (issue 40): a parked push's WRITE started by the publish itself and
// completed by a pthread that never takes the interpreter's lock.
//
// Why: in a serving process the runner goes on in Python after an encoder step publishes, and a
// Python I/O thread that must post the WRITE waits for the GIL again at every call (1 ms after
// the publish on an H100, 34x the copy). Here the owner (the endpoint's I/O thread) *arms* an
// entry when a consumer's Push waits for an item not published yet: where to write it (the
// consumer's prepped dlist and block) and the notification that lands it. The publishing thread
// *fires* it in the same call that publishes (one mutex, one futex wake), and this library's
// thread waits for the item's copy (a CUDA event), makes and posts the WRITE and polls it to its
// end. The owner *takes* the outcome when it next runs: every decision about what a failure means
// stays in Python, which this file never calls. So that the owner runs only when there is an
// outcome to take (not on every publish, not on a timer), the thread writes an eventfd the
// owner's poller watches once a pass ended entries: after the WRITE or the answer, never before.
//
// The same thread sends the Grant of a parked Hold or Get the publish answered (native_answers.py):
// the publisher encodes it, this thread waits for the item's copy and sends it from a ZMQ ROUTER
// socket (pyzmq's libzmq, its zmq_send given as an address) that no Python thread touches.
//
// It drives the endpoint's own NIXL agent through the nixl wheel's C API (libnixl_capi.so): the
// caller gives the entry points as addresses and the agent and prepped lists as the C API's
// one-pointer handles, so this file needs no NIXL header and links nothing but pthreads. The agent
// must then be thread-safe (NIXL_THREAD_SYNC_STRICT): the owner keeps calling it too.
// C++ only for std::atomic (torch's extension builder compiles every source as C++); the
// exported functions are extern "C" and ec_nixl/handoff.py loads them with ctypes.
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <new>

#include "nixl_capi_fns.h"

typedef int (*opt_new_fn)(void **opt);
typedef int (*opt_free_fn)(void *opt);
typedef int (*opt_flag_fn)(void *opt, bool on);
typedef int (*zmq_send_fn)(void *socket, const void *buf, size_t len, int flags);

enum { CU_NOT_READY = 600, OP_WRITE = 1, ZMQ_DONTWAIT_ = 1, ZMQ_SNDMORE_ = 2 };
enum { K_WRITE = 0, K_SEND = 1 };  // an entry's kind: a WRITE to post, or an answer to send
enum { FN_MAKE, FN_POST, FN_STATUS, FN_RELEASE, FN_DESTROY, FN_OPT_NEW, FN_OPT_FREE, FN_OPT_NOTIF,
       FN_OPT_MSG, FN_EV_QUERY, FN_CTX_SET, FN_COUNT };

// Entry states (the owner reads them through hx_take / hx_cancel).
enum { E_FREE = 0, E_ARMED = 1, E_FIRED = 2, E_POSTED = 3, E_DONE = 4, E_FAILED = 5, E_CANCELLED = 6,
       E_STARTING = 7 };  // (STARTING: the thread makes and posts it now; reads as FIRED to the owner)
// A failed entry's `status`: NIXL's (negative), or one of these.
enum { ERR_EVENT = -1000, ERR_NOMEM = -1001, ERR_NOSOCK = -1002, ERR_SEND = -2000 };  // ERR_SEND - errno

#define NOTIF_MAX 1024

typedef struct {
  int64_t key;
  int state, status, cancel;
  void *remote, *local, *event, *req;
  int32_t remote_block, capacity, local_block, nblocks;
  double t_fired, t_posted, t_done;
  int kind;
  char *payload;  // K_SEND: the routing id, then the message (freed once sent or cancelled)
  size_t id_len, body_len;
  size_t notif_len;
  char notif[NOTIF_MAX];
} entry;

struct hx {
  void *fn[FN_COUNT];
  void *agent, *ctx, *opt;
  double spin_s;       // spin this long for a publish after an arm or an expect, then sleep
  double poll_spin_s;  // poll a posted WRITE without sleeping this long after its post
  double last_post;
  int cap;
  entry *e;
  pthread_mutex_t mu;
  pthread_mutex_t zmu;  // around the answer socket: a send, or the owner taking the socket away
  int done_fd;          // eventfd written once a pass ended entries (-1: none)
  zmq_send_fn zsend;
  void *zsock;
  std::atomic<uint32_t> work{0};      // bumped by every fire/cancel/stop/expect: the thread's futex word
  std::atomic<uint32_t> sleeping{0};  // the thread is (about to be) in futex_wait
  std::atomic<int> stop{0};
  std::atomic<double> expect_until{0.0};  // a publish is expected until then: the thread spins
  pthread_t thread;
};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static void wake(hx *h) {
  h->work.fetch_add(1);
  if (h->sleeping.load()) syscall(SYS_futex, &h->work, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

// A publish is expected (a push armed, a Hold noted): a sleeping thread wakes and spins for
// spin_s, so the publish finds it awake (a futex wake of a thread asleep for long cost 100-240 us
// on an idle H100 host, where a busy one answered in 50). No spin where spin_s is 0.
static void expect(hx *h) {
  if (h->spin_s <= 0) return;
  h->expect_until.store(now_s() + h->spin_s);
  wake(h);
}

static entry *find(hx *h, int64_t key) {
  for (int i = 0; i < h->cap; i++)
    if (h->e[i].state != E_FREE && h->e[i].key == key) return &h->e[i];
  return NULL;
}

// The lock held: a free entry for `key`, cleared (its state is still E_FREE: the caller sets it),
// or NULL with *rc = -3 (the key is in use) or -1 (the table is full).
static entry *claim(hx *h, int64_t key, int *rc) {
  if (find(h, key)) {
    *rc = -3;
    return NULL;
  }
  for (int i = 0; i < h->cap; i++) {
    entry *x = &h->e[i];
    if (x->state != E_FREE) continue;
    memset(x, 0, offsetof(entry, notif));
    x->key = key;
    return x;
  }
  *rc = -1;
  return NULL;
}

// A K_SEND entry's message is let go of once it is sent, cancelled or its copy failed.
static void drop_payload(entry *x) {
  free(x->payload);
  x->payload = NULL;
}

// Send a K_SEND entry's message to its routing id, never blocking (a peer not connected, or one
// whose queue is full, fails it: the owner answers from Python then).
static int send_answer(hx *h, entry *x) {
  int st = 0;
  pthread_mutex_lock(&h->zmu);
  if (!h->zsend || !h->zsock) {
    st = ERR_NOSOCK;
  } else if (h->zsend(h->zsock, x->payload, x->id_len, ZMQ_SNDMORE_ | ZMQ_DONTWAIT_) < 0 ||
             h->zsend(h->zsock, x->payload + x->id_len, x->body_len, ZMQ_DONTWAIT_) < 0) {
    st = ERR_SEND - errno;
  }
  pthread_mutex_unlock(&h->zmu);
  x->t_posted = now_s();
  drop_payload(x);
  return st;
}

// Make and post one fired entry (the lock is not held: make and post may take tens of us).
static void start(hx *h, entry *x) {
  int n = x->nblocks, st;
  if (x->event) {
    while ((st = ((ev_query_fn)h->fn[FN_EV_QUERY])(x->event)) == CU_NOT_READY) relax();
    if (st != 0) {
      x->status = ERR_EVENT - st;
      drop_payload(x);
      return;
    }
  }
  if (x->kind == K_SEND) {
    x->status = send_answer(h, x);
    return;
  }
  int stack_idx[2 * 64];
  int *li = n <= 64 ? stack_idx : static_cast<int *>(malloc(2 * sizeof(int) * (size_t)n));
  if (!li) {
    x->status = ERR_NOMEM;
    return;
  }
  int *ri = li + n;
  for (int k = 0; k < n; k++) li[k] = x->local_block + k, ri[k] = x->remote_block + k;
  void *req = NULL;
  st = ((opt_msg_fn)h->fn[FN_OPT_MSG])(h->opt, x->notif, x->notif_len);
  if (st == CAPI_SUCCESS)
    st = ((make_fn)h->fn[FN_MAKE])(h->agent, OP_WRITE, x->local, li, (size_t)n, x->remote, ri, (size_t)n, &req, h->opt);
  if (li != stack_idx) free(li);
  if (st == CAPI_SUCCESS) {
    st = ((post_fn)h->fn[FN_POST])(h->agent, req, NULL);
    x->t_posted = h->last_post = now_s();
    if (st != CAPI_SUCCESS && st != CAPI_IN_PROG) {
      ((release_fn)h->fn[FN_RELEASE])(h->agent, req);
      ((destroy_fn)h->fn[FN_DESTROY])(req);
      req = NULL;
    }
  }
  x->req = req;
  x->status = st;
}

// One pass: start what was fired, poll what is posted. Returns how many are still posted; the
// owner's eventfd is written if any entry ended.
static int pass(hx *h) {
  int posted = 0, ended = 0;
  for (int i = 0; i < h->cap; i++) {
    entry *x = &h->e[i];
    pthread_mutex_lock(&h->mu);
    int state = x->state;
    if (state == E_FIRED && x->cancel) {  // cancelled before it was posted: it never writes
      x->state = state = E_CANCELLED, x->t_done = now_s();
      drop_payload(x);
      ended++;
    } else if (state == E_FIRED) {
      x->state = E_STARTING;
    }
    pthread_mutex_unlock(&h->mu);
    if (state == E_FIRED) {
      start(h, x);
      pthread_mutex_lock(&h->mu);
      if (x->req) {
        x->state = E_POSTED;
      } else {
        x->state = x->status == CAPI_SUCCESS ? E_DONE : E_FAILED;  // (a post that completed at once)
        x->t_done = now_s();
        ended++;
      }
      state = x->state;
      pthread_mutex_unlock(&h->mu);
    }
    if (state != E_POSTED) continue;
    int st = ((status_fn)h->fn[FN_STATUS])(h->agent, x->req);
    pthread_mutex_lock(&h->mu);
    if (st == CAPI_IN_PROG && x->cancel && ((release_fn)h->fn[FN_RELEASE])(h->agent, x->req) == CAPI_SUCCESS) {
      ((destroy_fn)h->fn[FN_DESTROY])(x->req);
      x->req = NULL, x->state = E_CANCELLED, x->t_done = now_s();
      ended++;
    } else if (st != CAPI_IN_PROG) {
      ((release_fn)h->fn[FN_RELEASE])(h->agent, x->req);
      ((destroy_fn)h->fn[FN_DESTROY])(x->req);
      x->req = NULL, x->status = st, x->t_done = now_s();
      x->state = st == CAPI_SUCCESS ? E_DONE : E_FAILED;
      ended++;
    } else {
      posted++;
    }
    pthread_mutex_unlock(&h->mu);
  }
  if (ended && h->done_fd >= 0) {
    uint64_t one = 1;
    ssize_t rc = write(h->done_fd, &one, sizeof one);  // (EAGAIN: the counter is full, the owner is awake)
    (void)rc;
  }
  return posted;
}

// Sleep until the work word moves from `seen` (a fire, a cancel, stop) or `timeout_s` passes (< 0: no limit).
static void sleep_on_work(hx *h, uint32_t seen, double timeout_s) {
  struct timespec t, *tp = NULL;
  if (timeout_s >= 0) {
    t.tv_sec = (time_t)timeout_s;
    t.tv_nsec = (long)((timeout_s - (double)t.tv_sec) * 1e9);
    tp = &t;
  }
  h->sleeping.store(1);
  if (h->work.load() == seen && !h->stop.load()) syscall(SYS_futex, &h->work, FUTEX_WAIT_PRIVATE, seen, tp, NULL, 0);
  h->sleeping.store(0);
}

static void *run(void *arg) {
  hx *h = (hx *)arg;
  if (h->fn[FN_CTX_SET] && h->ctx) ((ctx_set_fn)h->fn[FN_CTX_SET])(h->ctx);
  uint32_t seen = h->work.load();
  while (!h->stop.load()) {
    int posted = pass(h);
    uint32_t w = h->work.load();
    if (w != seen) {  // fired or cancelled meanwhile: another pass at once
      seen = w;
      continue;
    }
    if (posted > 0) {
      // A WRITE in flight (a GPU WRITE of one image takes 20-100 us): poll without sleeping for
      // poll_spin_s after the last post, then sleep between polls, longer as the WRITE ages (its
      // end may need the consumer's UCX to run, on CPUs a spinning thread would take from it).
      double age = now_s() - h->last_post;
      if (age < h->poll_spin_s) {
        relax();
        continue;
      }
      double d = age / 4;
      sleep_on_work(h, seen, d < 20e-6 ? 20e-6 : d > 200e-6 ? 200e-6 : d);
      continue;
    }
    double until = h->expect_until.load();
    if (until > now_s()) {  // a publish is expected: spin until it comes or the bound passes
      while (h->work.load() == seen && now_s() < until && !h->stop.load()) relax();
      if (h->work.load() != seen) continue;
    }
    sleep_on_work(h, seen, -1.0);
  }
  return NULL;
}

// ---------------------------------------------------------------- the owner's and publisher's API


// fns: FN_COUNT entry points (FN_EV_QUERY and FN_CTX_SET may be NULL: no CUDA); agent: the C
// API's agent handle; ctx: the CUDA context the thread makes current (or NULL); spin_us: how long
// the thread spins for a publish after an arm or hx_expect before it sleeps; poll_spin_us: how long
// it polls a posted WRITE without sleeping after its post; cap: entries at most; done_fd: an
// eventfd (non-blocking) written when entries end, for the owner to take them (-1: none).
extern "C" {

hx *hx_start(void *const fns[FN_COUNT], void *agent, void *ctx, double spin_us, double poll_spin_us, int cap,
             int done_fd) {
  hx *h = new (std::nothrow) hx();
  if (!h) return NULL;
  memcpy(h->fn, fns, sizeof h->fn);
  h->agent = agent, h->ctx = ctx, h->spin_s = spin_us * 1e-6, h->poll_spin_s = poll_spin_us * 1e-6, h->cap = cap;
  h->done_fd = done_fd;
  h->e = static_cast<entry *>(calloc((size_t)cap, sizeof(entry)));
  if (!h->e || ((opt_new_fn)h->fn[FN_OPT_NEW])(&h->opt) != CAPI_SUCCESS ||
      ((opt_flag_fn)h->fn[FN_OPT_NOTIF])(h->opt, true) != CAPI_SUCCESS) {
    free(h->e);
    delete h;
    return NULL;
  }
  pthread_mutex_init(&h->mu, NULL);
  pthread_mutex_init(&h->zmu, NULL);
  if (pthread_create(&h->thread, NULL, run, h) != 0) {
    ((opt_free_fn)h->fn[FN_OPT_FREE])(h->opt);
    free(h->e);
    delete h;
    return NULL;
  }
  pthread_setname_np(h->thread, "ec-nixl-hx");  // (top -H, /proc/PID/task/*/comm)
  return h;
}

// Owner: `key` WRITEs into `capacity` blocks at `remote_block` of the prepped list `remote`, with
// `notif`, once fired. 0, or -1 (the table is full), -2 (notif too long), -3 (the key is in use).
int hx_arm(hx *h, int64_t key, void *remote, int32_t remote_block, int32_t capacity, const char *notif,
           size_t notif_len) {
  if (notif_len > NOTIF_MAX) return -2;
  int rc;
  pthread_mutex_lock(&h->mu);
  entry *x = claim(h, key, &rc);
  if (x) {
    x->state = E_ARMED, x->remote = remote, x->remote_block = remote_block;
    x->capacity = capacity, x->notif_len = notif_len;
    memcpy(x->notif, notif, notif_len);
    rc = 0;
  }
  pthread_mutex_unlock(&h->mu);
  if (rc == 0) expect(h);
  return rc;
}

// Owner: a Hold or Get waits for an item the publish will answer (native answers): spin for it.
void hx_expect(hx *h) { expect(h); }

// Publisher: the item of armed `key` is published at `nblocks` blocks from `local_block` of the
// prepped list `local`, its bytes complete once `event` is (NULL: already). 1 if its WRITE starts
// now; 0 if the key is not armed (never armed, taken back, or fired already); -1 if the item does
// not fit the consumer's slot (the entry stays armed: the owner refuses the push).
int hx_fire(hx *h, int64_t key, void *local, int32_t local_block, int32_t nblocks, void *event) {
  int rc = 0;
  pthread_mutex_lock(&h->mu);
  entry *x = find(h, key);
  if (x && x->state == E_ARMED) {
    if (nblocks <= 0 || nblocks > x->capacity) {
      rc = -1;
    } else {
      x->local = local, x->local_block = local_block, x->nblocks = nblocks, x->event = event;
      x->state = E_FIRED, x->t_fired = now_s();
      rc = 1;
    }
  }
  pthread_mutex_unlock(&h->mu);
  if (rc == 1) wake(h);
  return rc;
}

// Owner: the ROUTER socket answers go out on, and pyzmq's zmq_send (NULL, NULL: none; returns
// once no send is using the previous one, so the caller may close it). The socket is this
// thread's alone from now on: no Python thread may use it until it is taken away.
void hx_answer_socket(hx *h, void *zsend, void *zsock) {
  pthread_mutex_lock(&h->zmu);
  h->zsend = (zmq_send_fn)zsend, h->zsock = zsock;
  pthread_mutex_unlock(&h->zmu);
}

// Publisher: send `body` to the peer routed as `id` on the answer socket once `event` is
// complete (NULL: now). 1 if queued; -1 (the table is full), -3 (the key is in use), -4 (no
// answer socket), -5 (no memory). The outcome is read with hx_take (DONE: sent).
int hx_send(hx *h, int64_t key, void *event, const char *id, size_t id_len, const char *body, size_t body_len) {
  if (!h->zsock) return -4;
  char *p = static_cast<char *>(malloc(id_len + body_len ? id_len + body_len : 1));
  if (!p) return -5;
  memcpy(p, id, id_len);
  memcpy(p + id_len, body, body_len);
  int rc;
  pthread_mutex_lock(&h->mu);
  entry *x = claim(h, key, &rc);
  if (x) {
    x->kind = K_SEND, x->payload = p, x->id_len = id_len, x->body_len = body_len;
    x->event = event, x->state = E_FIRED, x->t_fired = now_s();
    rc = 1;
  }
  pthread_mutex_unlock(&h->mu);
  if (rc == 1)
    wake(h);
  else
    free(p);
  return rc;
}

// Owner: where `key` stands. An armed entry is taken back (it never fires now); a finished one
// (DONE, FAILED, CANCELLED) is forgotten; a fired or posted one stays. Returns the state (E_FREE:
// unknown key); `status` gets NIXL's status of a failed one, `stamps` [fired, posted, done].
int hx_take(hx *h, int64_t key, int *status, double stamps[3]) {
  pthread_mutex_lock(&h->mu);
  entry *x = find(h, key);
  int state = x ? x->state : E_FREE;
  if (state == E_STARTING) state = E_FIRED;
  if (x) {
    *status = x->status;
    stamps[0] = x->t_fired, stamps[1] = x->t_posted, stamps[2] = x->t_done;
    if (state == E_ARMED || state == E_DONE || state == E_FAILED || state == E_CANCELLED) x->state = E_FREE;
  }
  pthread_mutex_unlock(&h->mu);
  return state;
}

// Owner: stop `key`'s WRITE. Armed: taken back, never fires (returns E_ARMED). Fired, not posted
// yet: ends CANCELLED without posting, unless the thread already took it (then as posted).
// Posted: released as soon as NIXL lets go (it cancels what it can): the entry ends CANCELLED,
// or DONE/FAILED if it finished first. Returns the state before; hx_take reads the outcome.
int hx_cancel(hx *h, int64_t key) {
  pthread_mutex_lock(&h->mu);
  entry *x = find(h, key);
  int state = x ? x->state : E_FREE;
  if (state == E_STARTING) state = E_FIRED;
  if (x) {
    if (state == E_ARMED) {
      x->state = E_FREE;
    } else {
      x->cancel = 1;
    }
  }
  pthread_mutex_unlock(&h->mu);
  if (x && state != E_ARMED) wake(h);
  return state;
}

// Owner, before it releases the prepped list `remote` (its peer went away): entries armed on it
// are taken back, fired ones are cancelled, and this returns once none is still being made or
// posted over it (the thread needs microseconds for that), or after `timeout_s` (then 0, else 1).
// Posted requests no longer use the list; they end as hx_cancel says.
int hx_quiesce(hx *h, void *remote, double timeout_s) {
  double until = now_s() + timeout_s;
  for (int first = 1;; first = 0) {
    int busy = 0;
    pthread_mutex_lock(&h->mu);
    for (int i = 0; i < h->cap; i++) {
      entry *x = &h->e[i];
      if (x->state == E_FREE || x->remote != remote) continue;
      if (first && x->state == E_ARMED) {
        x->state = E_FREE;
        continue;
      }
      if (first) x->cancel = 1;
      busy += x->state == E_FIRED || x->state == E_STARTING;
    }
    pthread_mutex_unlock(&h->mu);
    if (!busy) return 1;
    wake(h);
    if (now_s() > until) return 0;
    struct timespec t = {0, 20000};
    nanosleep(&t, NULL);
  }
}

// Entries not free (armed, fired, posted or finished and not taken yet).
int hx_count(hx *h) {
  int n = 0;
  pthread_mutex_lock(&h->mu);
  for (int i = 0; i < h->cap; i++) n += h->e[i].state != E_FREE;
  pthread_mutex_unlock(&h->mu);
  return n;
}

// Stops the thread after a last pass; WRITEs still posted are released (NIXL cancels them).
void hx_stop(hx *h) {
  h->stop.store(1);
  wake(h);
  syscall(SYS_futex, &h->work, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
  pthread_join(h->thread, NULL);
  for (int i = 0; i < h->cap; i++) {
    entry *x = &h->e[i];
    if (x->req) {
      ((release_fn)h->fn[FN_RELEASE])(h->agent, x->req);
      ((destroy_fn)h->fn[FN_DESTROY])(x->req);
    }
    free(x->payload);
  }
  ((opt_free_fn)h->fn[FN_OPT_FREE])(h->opt);
  pthread_mutex_destroy(&h->mu);
  pthread_mutex_destroy(&h->zmu);
  free(h->e);
  delete h;
}

}  // extern "C"
