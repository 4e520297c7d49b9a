// ar_leaks.inc.cu — part of bench/ar_bench.cu (included there, one
// translation unit): `--leak N`: N create/destroy cycles of the VMM mapping
// and of the all-reduce handle leak neither fds nor device memory.

// ------------------------------------------------------------------ leaks

static int count_fds() {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (struct dirent *e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static void leaks(int cycles) {
  size_t fr0, fr1, tot;
  // warm up: first creates initialise driver state
  for (int i = 0; i < 5; i++) {
    weft_vmm *w;
    WK(weft_vmm_create(g_grp, 64 << 20, 0, &w));
    WK(weft_vmm_destroy(w));
  }
  CK(cudaDeviceSynchronize());
  int fd0 = count_fds();
  CK(cudaMemGetInfo(&fr0, &tot));
  int64_t live0, bytes0;
  weft_vmm_stats(&live0, &bytes0, NULL);
  double t0 = now_s();
  for (int i = 0; i < cycles; i++) {
    weft_vmm *w;
    WK(weft_vmm_create(g_grp, (size_t)(1 + i % 7) << 20, 0, &w));
    void *p;
    WK(weft_vmm_ptr(w, (g_rank + 1) % g_world, &p));  // touch a peer's mapping
    CK(cudaMemsetAsync(p, 0, 4096, g_s));
    CK(cudaStreamSynchronize(g_s));
    barrier();  // peers finish writing before anyone destroys (destroy is local)
    WK(weft_vmm_destroy(w));
  }
  double dt = now_s() - t0;
  CK(cudaDeviceSynchronize());
  int fd1 = count_fds();
  CK(cudaMemGetInfo(&fr1, &tot));
  int64_t live1, bytes1;
  weft_vmm_stats(&live1, &bytes1, NULL);
  char name[96];
  snprintf(name, sizeof name, "vmm %d create/destroy cycles leak nothing", cycles);
  const double leaked_mib = ((double)fr0 - (double)fr1) / (1 << 20);
  check(fd1 == fd0 && leaked_mib < 64 && live1 == live0, name,
        "fds %d -> %d, device free %.1f MiB less, live %lld -> %lld", fd0, fd1, leaked_mib,
        (long long)live0, (long long)live1);
  LOG("leak: %d vmm cycles in %.2f s (%.2f ms each); fds %d -> %d; free device memory %+.1f MiB",
      cycles, dt, dt * 1e3 / cycles, fd0, fd1, -leaked_mib);
  // the all-reduce handle too (workspace + pinned words + init)
  const int arc = std::max(10, cycles / 10);
  fd0 = count_fds();
  CK(cudaMemGetInfo(&fr0, &tot));
  for (int i = 0; i < arc; i++) {
    weft_ar *ar;
    WK(weft_ar_create(g_grp, 4 << 20, &ar));
    DBuf b;
    b.alloc(1 << 16);
    WK(weft_ar_run(ar, b.p, b.p, 1 << 15, WEFT_BF16, i % 3 + 1, g_s));
    CK(cudaStreamSynchronize(g_s));
    WK(weft_ar_check_error(ar));
    barrier();
    WK(weft_ar_destroy(ar));
  }
  CK(cudaDeviceSynchronize());
  fd1 = count_fds();
  CK(cudaMemGetInfo(&fr1, &tot));
  snprintf(name, sizeof name, "allreduce %d create/run/destroy cycles leak nothing", arc);
  check(fd1 == fd0 && ((double)fr0 - (double)fr1) / (1 << 20) < 64, name, "fds %d -> %d, device free %.1f MiB less",
        fd0, fd1, ((double)fr0 - (double)fr1) / (1 << 20));
}
