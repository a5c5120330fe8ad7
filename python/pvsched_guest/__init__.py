"""The QEMU guest harness: what the Linux-guest tests (tests/linux-guest)
and the Linux-guest benchmarks (pvsched_bench s4 and s6) share.

  abi      the ABI constants and offsets, generated from the C/Rust layout
           list (never edited by hand)
  policy   the BPF policy's constants (decision kinds and reasons, as in
           the agent's trace) and records, generated the same way from
           the bpf-policy/intf.h list
  host     host-side helpers: failures, commands, child processes, a
           thread's scheduling attributes
  qmp      one QMP command on QEMU's monitor socket
  region   the guest region inside QEMU's memfd RAM: finding it, reading
           it, and the vCPU threads and slot addresses an agent attaches to
  kernel   guest kernels, the module built against them, initramfs images
  bench    what the Linux-guest benchmarks share on the host: processes
           always stopped, console output between marks, cyclictest's
           results (the statistics over repetitions are pvsched-bench's)
  boot     one QEMU boot with its pvsched-device peer, its serial console
           marks and the device's view of the region at each mark

Run with the repository's `python/` directory on PYTHONPATH (the tests'
conftest puts it on sys.path).

  initramfs/  the test initramfs's /init (init.sh) and its static helper
              (pvsched-helper.c), which kernel.build_initramfs packs
"""
