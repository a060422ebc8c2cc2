// A threadgroup (a CUDA block) run on one OS thread: each of its threads is a fiber with a
// stack of its own, run until it waits at a barrier or ends, then the next one. A barrier
// lets its waiters go once every thread it counts has arrived (a threadgroup's, or a
// simdgroup's 32 lanes). A barrier then costs a stack switch a thread, where 256 std::threads
// on a 2-core machine cost a wake-up and a reschedule each. Between two barriers the threads
// run one after another in index order; a barrier some threads never reach stops the run with
// a message (a GPU would hang). The switch is a few lines of assembly, for x86-64 and arm64.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// emu_fiber_switch(save, sp): saves the callee-saved registers on this stack and the stack
// pointer in *save, then takes up the stack at sp and returns into whatever saved it.
extern "C" void emu_fiber_switch(void** save, void* sp) __asm__("emu_fiber_switch");
#if defined(__x86_64__)
asm(".text\n.globl emu_fiber_switch\n.p2align 4\nemu_fiber_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n");
#elif defined(__aarch64__)
asm(".text\n.globl emu_fiber_switch\n.p2align 2\nemu_fiber_switch:\n"
    "  sub sp, sp, #160\n"
    "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n  stp d12, d13, [sp, #128]\n  stp d14, d15, [sp, #144]\n"
    "  mov x9, sp\n  str x9, [x0]\n  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #160\n  ret\n");
#else
#error "tests/emulation/fibers.h switches stacks on x86-64 and arm64 only"
#endif

namespace emu {
constexpr unsigned MAX_THREADS = 256;
constexpr size_t STACK_BYTES = 256 << 10;
constexpr uint64_t STACK_END_MARK = 0x5AFE57AC5AFE57ACull;

struct Barrier {
  unsigned count, arrived = 0, generation = 0;
};

struct Fiber {
  void* sp;
  Barrier* waiting;  // the barrier it waits at (until its generation moves on), or null
  unsigned generation;
  bool done;
};

struct Group {
  Fiber fibers[MAX_THREADS];
  unsigned current = 0;
  void* scheduler = nullptr;
  char* stacks = nullptr;
  void (*call)(void*) = nullptr;
  void* body = nullptr;
};
inline Group group;

[[noreturn]] inline void fiber_main() {
  group.call(group.body);
  Fiber& f = group.fibers[group.current];
  f.done = true;
  emu_fiber_switch(&f.sp, group.scheduler);
  std::abort();  // a finished fiber is never resumed
}

// The running thread waits until all b.count threads have arrived at b.
inline void wait(Barrier& b) {
  if (++b.arrived == b.count) {
    b.arrived = 0;
    b.generation++;
    return;
  }
  Fiber& f = group.fibers[group.current];
  f.waiting = &b;
  f.generation = b.generation;
  emu_fiber_switch(&f.sp, group.scheduler);
}

// A fresh stack for fiber t whose first switch enters fiber_main as if called.
inline void* fresh_stack(unsigned t) {
  char* low = group.stacks + size_t(t) * STACK_BYTES;
  std::memcpy(low, &STACK_END_MARK, sizeof STACK_END_MARK);
  void** top = reinterpret_cast<void**>(low + STACK_BYTES);
#if defined(__x86_64__)
  *--top = nullptr;  // fiber_main's return address (it never returns)
  *--top = reinterpret_cast<void*>(&fiber_main);
  for (int r = 0; r < 6; r++) *--top = nullptr;  // rbp rbx r12..r15
#else
  top -= 20;  // x19..x30, d8..d15; x30 (the return address) in slot 11
  std::memset(top, 0, 20 * sizeof(void*));
  top[11] = reinterpret_cast<void*>(&fiber_main);
#endif
  return top;
}

// Runs body() once on each of `threads` threads; enter(t) sets thread t's position (the
// variables the built-ins read) each time it is resumed.
template <typename F> void run_group(unsigned threads, F& body, void (*enter)(unsigned)) {
  if (group.stacks == nullptr) group.stacks = static_cast<char*>(std::malloc(MAX_THREADS * STACK_BYTES));
  group.call = [](void* b) { (*static_cast<F*>(b))(); };
  group.body = &body;
  for (unsigned t = 0; t < threads; t++) group.fibers[t] = Fiber{fresh_stack(t), nullptr, 0, false};
  for (unsigned finished = 0; finished < threads;) {
    bool ran = false;
    for (unsigned t = 0; t < threads; t++) {
      Fiber& f = group.fibers[t];
      if (f.done || (f.waiting != nullptr && f.waiting->generation == f.generation)) continue;
      f.waiting = nullptr;
      group.current = t;
      enter(t);
      emu_fiber_switch(&group.scheduler, f.sp);
      ran = true;
      finished += f.done;
    }
    if (!ran) {
      std::fprintf(stderr, "%u of %u threads wait at a barrier the others never reach\n", threads - finished, threads);
      std::abort();
    }
  }
  for (unsigned t = 0; t < threads; t++) {
    if (std::memcmp(group.stacks + size_t(t) * STACK_BYTES, &STACK_END_MARK, sizeof STACK_END_MARK) != 0) {
      std::fprintf(stderr, "thread %u overflowed its %zu-byte stack\n", t, STACK_BYTES);
      std::abort();
    }
  }
}
}  // namespace emu
