/* The clock and futex calls of the libraries whose helper thread sleeps between calls
   (column_halves.c, chain_halves.c): a monotonic clock in nanoseconds, and a wait on /
   a wake of a word private to the process. */
#ifndef DYNVM_HELPER_SYNC_H
#define DYNVM_HELPER_SYNC_H

#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Sleep while *word == expected (returns at once where it no longer is). */
static inline void futex_wait(atomic_int *word, int expected) {
  syscall(SYS_futex, (int *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

/* Wake up to `waiters` threads sleeping on word. */
static inline void futex_wake(atomic_int *word, int waiters) {
  syscall(SYS_futex, (int *)word, FUTEX_WAKE_PRIVATE, waiters, NULL, NULL, 0);
}

#endif
