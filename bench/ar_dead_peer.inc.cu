// ar_dead_peer.inc.cu — part of bench/ar_bench.cu (included there, one
// translation unit): `--dead-peer`: a peer that skips a call is reported
// within the timeout, and an abort ends a waiting kernel.

// ------------------------------------------------------------------ dead peer

struct AbortArg { weft_ar *ar; double delay; };
static void *abort_later(void *p) {
  AbortArg *a = (AbortArg *)p;
  usleep((useconds_t)(a->delay * 1e6));
  weft_ar_abort(a->ar);
  return NULL;
}

static void dead_peer(size_t ws_bytes) {
  DBuf b;
  b.alloc(8 << 20);
  const int algos[] = {1, 2, 3};
  const size_t ns[] = {4096, 1u << 20, 1u << 20};
  const int tmo_ms = 2000;
  for (int i = 0; i < 3; i++) {
    weft_ar *ar;
    WK(weft_ar_create(g_grp, ws_bytes, &ar));
    WK(weft_ar_set_timeout(ar, tmo_ms));
    // two good calls first
    for (int k = 0; k < 2; k++) WK(weft_ar_run(ar, b.p, b.p, ns[i], WEFT_BF16, algos[i], g_s));
    CK(cudaStreamSynchronize(g_s));
    WK(weft_ar_check_error(ar));
    barrier();
    char name[96];
    snprintf(name, sizeof name, "dead peer reported (%s, timeout %d ms)", algon(algos[i]), tmo_ms);
    if (g_rank == 1) {
      LOG("dead-peer: rank 1 skips the call");
    } else {
      double t0 = now_s();
      WK(weft_ar_run(ar, b.p, b.p, ns[i], WEFT_BF16, algos[i], g_s));
      cudaError_t e = cudaStreamSynchronize(g_s);
      double dt = now_s() - t0;
      int rc = weft_ar_check_error(ar);
      std::string msg = weft_last_error();
      if (g_rank == 0)
        check(e == cudaSuccess && rc == WEFT_ETIMEOUT && msg.find("peer 1") != std::string::npos &&
                  dt < tmo_ms / 1000.0 + 3.0,
              name, "sync %s, rc %d after %.2f s: %s", cudaGetErrorString(e), rc, dt, msg.c_str());
      else
        LOG("dead-peer: rank %d: rc %d after %.2f s", g_rank, rc, dt);
      if (g_rank == 0) LOG("dead-peer message: %s", msg.c_str());
      int rc2 = weft_ar_run(ar, b.p, b.p, 16, WEFT_BF16, 1, g_s);
      if (g_rank == 0) check(rc2 == WEFT_ESTATE, "failed handle refuses further calls", "rc %d", rc2);
    }
    barrier();
    WK(weft_ar_destroy(ar));
  }
  // abort: rank 1 skips, rank 0 waits with a long timeout, a thread aborts
  {
    weft_ar *ar;
    WK(weft_ar_create(g_grp, ws_bytes, &ar));
    WK(weft_ar_set_timeout(ar, 60000));
    WK(weft_ar_run(ar, b.p, b.p, 4096, WEFT_BF16, 1, g_s));
    CK(cudaStreamSynchronize(g_s));
    barrier();
    if (g_rank == 0) {
      pthread_t th;
      AbortArg aa{ar, 0.5};
      double t0 = now_s();
      WK(weft_ar_run(ar, b.p, b.p, 4096, WEFT_BF16, 1, g_s));
      pthread_create(&th, NULL, abort_later, &aa);
      cudaError_t e = cudaStreamSynchronize(g_s);
      double dt = now_s() - t0;
      pthread_join(th, NULL);
      int rc = weft_ar_check_error(ar);
      check(e == cudaSuccess && rc == WEFT_EABORT && dt < 10.0, "abort ends a waiting kernel",
            "sync %s rc %d after %.2f s: %s", cudaGetErrorString(e), rc, dt, weft_last_error());
    }
    barrier();
    WK(weft_ar_destroy(ar));
  }
}
