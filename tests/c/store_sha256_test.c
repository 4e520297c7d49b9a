/* store_sha256_test.c — known-answer test for src/store/sha256.c (FIPS 180-4
 * examples, RFC 4231 HMAC-SHA256 cases). Prints one line per failure and
 * "sha256: N passed, M failed"; exit status 0 only when all pass.
 * Build: cc -O2 -Isrc tests/c/store_sha256_test.c src/store/sha256.c */
#include "store/sha256.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed, failed;

static void hex(const uint8_t *d, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static void expect(const char *name, const uint8_t got[32], const char *want) {
  char h[65];
  hex(got, 32, h);
  if (strcmp(h, want) == 0) { passed++; return; }
  failed++;
  printf("FAIL %s: got %s want %s\n", name, h, want);
}

static void unhex(const char *s, uint8_t *out, size_t *n) {
  size_t len = strlen(s) / 2;
  for (size_t i = 0; i < len; i++) sscanf(s + 2 * i, "%2hhx", &out[i]);
  *n = len;
}

int main(void) {
  uint8_t d[32];
  wf_sha256("abc", 3, d);
  expect("sha256 abc", d, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  wf_sha256("", 0, d);
  expect("sha256 empty", d, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const char *m2 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  wf_sha256(m2, strlen(m2), d);
  expect("sha256 448-bit", d, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const char *m3 = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
  wf_sha256(m3, strlen(m3), d);
  expect("sha256 896-bit", d, "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");

  /* One million 'a', fed in uneven pieces to exercise the buffering. */
  char *a = malloc(1000000);
  memset(a, 'a', 1000000);
  wf_sha256_ctx c;
  wf_sha256_init(&c);
  size_t off = 0, step = 1;
  while (off < 1000000) {
    size_t n = (1000000 - off < step) ? 1000000 - off : step;
    wf_sha256_update(&c, a + off, n);
    off += n;
    step = step * 3 % 997 + 1;
  }
  wf_sha256_final(&c, d);
  expect("sha256 million a", d, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  free(a);

  /* RFC 4231 test cases 1, 2, 3, 4, 6, 7 (full-length outputs). */
  struct { const char *key, *data, *mac; } hm[] = {
    {"0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b", "4869205468657265",
     "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
    {"4a656665", "7768617420646f2079612077616e7420666f72206e6f7468696e673f",
     "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
    {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
     "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd",
     "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
    {"0102030405060708090a0b0c0d0e0f10111213141516171819",
     "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",
     "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
    {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
     "54657374205573696e67204c6172676572205468616e20426c6f636b2d53697a65204b6579202d2048617368204b6579204669727374",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
    {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
     "5468697320697320612074657374207573696e672061206c6172676572207468616e20626c6f636b2d73697a65206b657920616e642061206c6172676572207468616e20626c6f636b2d73697a6520646174612e20546865206b6579206e6565647320746f20626520686173686564206265666f7265206265696e6720757365642062792074686520484d414320616c676f726974686d2e",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (size_t i = 0; i < sizeof hm / sizeof hm[0]; i++) {
    uint8_t key[200], data[200];
    size_t kl, dl;
    char name[32];
    unhex(hm[i].key, key, &kl);
    unhex(hm[i].data, data, &dl);
    wf_hmac_sha256(key, kl, data, dl, d);
    snprintf(name, sizeof name, "hmac rfc4231 #%zu", i);
    expect(name, d, hm[i].mac);
  }

  uint8_t x[4] = {1, 2, 3, 4}, y[4] = {1, 2, 3, 5};
  if (wf_ct_equal(x, x, 4) && !wf_ct_equal(x, y, 4)) passed++;
  else { failed++; printf("FAIL ct_equal\n"); }

  printf("sha256: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
