/* gemm_cpu.c's products of many rows on int8 blocks, its AVX2 panel (panel_rows, the real 256-bit intrinsics) and
 * its VNNI panel (panel_rows512, on the model of the 512-bit ones), each with its own packing (pack_rows and
 * pack_tile, pasted before this by the test twice: *_256 with q8 codes signed, *_512 with them plus 128), on the
 * same weights and activations: q4 and q8, row-major (a short last panel) and in tiles, groups of 32 and 64, with
 * offsets and without, rows in the kernels' steps and past them. Every output the same bits, and near a
 * double-precision sum of the same codes. Prints "<bad> of <outputs> outputs differ"; exits 1 if any does. */
static uint16_t f2h(float f) { return (uint16_t)_cvtss_sh(f, 0); }

int main(void) {
    srand(11);
    int bad = 0, cases = 0;
    const int64_t Ks[] = {64, 576}, gs[] = {32, 64}, M = 11;
    for (int bits = 4; bits <= 8; bits += 4)
        for (int tiled = 0; tiled < 2; tiled++)
            for (int ki = 0; ki < 2; ki++)
                for (int gi = 0; gi < 2; gi++)
                    for (int offs = 0; offs < 2; offs++) {
                        const int64_t K = Ks[ki], g = gs[gi], G = K / g, B = K / 32, N = tiled ? 48 : 37;
                        const int64_t T = (N + 15) / 16, bytes = bits == 4 ? N * K / 2 : N * K;
                        uint8_t *q = malloc(T * 16 * K);
                        uint16_t *d = malloc(T * 16 * G * 2), *mn = malloc(T * 16 * G * 2);
                        for (int64_t i = 0; i < bytes; i++) q[i] = rand() & 255;
                        for (int64_t i = 0; i < N * G; i++) {
                            d[i] = f2h((rand() % 1000 + 1) * 1e-5f);
                            mn[i] = f2h(((rand() % 1000) - 500) * 1e-4f);
                        }
                        /* activations as tkv_int8_rows holds them: codes, scales, scaled sums, code sums */
                        int8_t *xq = malloc(M * K);
                        float *sx = malloc(M * B * 4), *xs = malloc(M * B * 4), bias[48];
                        int32_t *qs = malloc(M * B * 4);
                        for (int64_t i = 0; i < M * K; i++) xq[i] = (int8_t)(rand() % 255 - 127);
                        for (int64_t i = 0; i < M * B; i++) {
                            int32_t sum = 0;
                            for (int j = 0; j < 32; j++) sum += xq[i * 32 + j];
                            sx[i] = (rand() % 1000 + 1) * 1e-3f;
                            qs[i] = sum;
                            xs[i] = sx[i] * (float)sum;
                        }
                        for (int i = 0; i < 48; i++) bias[i] = ((rand() % 2001) - 1000) * 1e-3f;
                        /* the rows laid out for the 512-bit panel, a group of 8 at a time, as tkv_quant_gemm does */
                        const tkv_int8_rows rows = {xq, sx, xs, qs};
                        char *groups = malloc((M + 7) / 8 * rows512_bytes(K));
                        for (int64_t i = 0; i < M; i += 8)
                            lay_out_rows512(&rows, M, K, i, groups + i / 8 * rows512_bytes(K));
                        uint8_t *p256 = malloc(K * 16), *p512 = malloc(K * 16);
                        float pd[2 * 16 * 18], pm[2 * 16 * 18], pd2[2 * 16 * 18], pm2[2 * 16 * 18];
                        const uint16_t *m = offs ? mn : NULL;
                        for (int64_t t = 0; t < T; t++) {
                            if (tiled) {
                                pack_tile_256(bits, q, d, m, g, K, t, p256, pd, pm);
                                pack_tile_512(bits, q, d, m, g, K, t, p512, pd2, pm2);
                            } else {
                                pack_rows_256(bits, q, d, m, g, N, K, t * 16, p256, pd, pm);
                                pack_rows_512(bits, q, d, m, g, N, K, t * 16, p512, pd2, pm2);
                            }
                            const int rows = N - t * 16 < 16 ? (int)(N - t * 16) : 16;
                            const __mmask16 keep = (__mmask16)((1u << rows) - 1);
                            float a[11 * 16], o[4 * 16], v[11 * 48];
                            for (int64_t i = 0; i < M; i += 4) {
                                const int mr = M - i < 4 ? (int)(M - i) : 4;
                                panel_rows(bits, mr, p256, pd, pm, K, g / 32, xq + i * K, sx + i * B, xs + i * B, o);
                                for (int j = 0; j < mr; j++)
                                    for (int r = 0; r < rows; r++) a[(i + j) * 16 + r] = o[j * 16 + r] + bias[t * 16 + r];
                            }
                            for (int64_t i = 0; i < M; i += 8) {
                                const int mr = M - i < 8 ? (int)(M - i) : 8;
                                panel_rows512(bits, mr, p512, pd2, pm2, K, g / 32,
                                              rows512_at(groups + i / 8 * rows512_bytes(K), K),
                                              _mm512_maskz_loadu_ps(keep, bias + t * 16), keep, 48, v + i * 48);
                            }
                            for (int64_t i = 0; i < M; i++)
                                for (int r = 0; r < rows; r++) {
                                    /* the codes as the AVX2 panel holds them: panel[b][c][r][j] */
                                    double ref = bias[t * 16 + r];
                                    for (int64_t b = 0; b < B; b++) {
                                        long s = 0;
                                        for (int j = 0; j < 32; j++) {
                                            const uint8_t c = p256[b * 512 + (j / 4) * 64 + r * 4 + j % 4];
                                            s += (long)(bits == 4 ? c : (int8_t)c) * xq[i * K + b * 32 + j];
                                        }
                                        ref += (double)s * pd[b * 32 / g * 16 + r] * sx[i * B + b] +
                                               (double)pm[b * 32 / g * 16 + r] * xs[i * B + b];
                                    }
                                    const float x256 = a[i * 16 + r], x512 = v[i * 48 + r];
                                    cases++;
                                    if (memcmp(&x256, &x512, 4) != 0 || fabs(x256 - ref) > 1e-4 * (fabs(ref) + 1)) {
                                        if (bad++ < 10)
                                            printf("q%d tiled %d K %ld g %ld offs %d row %ld out %ld: avx2 %.9g vnni %.9g"
                                                   " ref %.9g\n", bits, tiled, (long)K, (long)g, offs, (long)i,
                                                   (long)(t * 16 + r), x256, x512, ref);
                                    }
                                }
                        }
                        free(q); free(d); free(mn); free(xq); free(sx); free(xs); free(qs); free(p256); free(p512);
                        free(groups);
                    }
    printf("%d of %d outputs differ\n", bad, cases);
    return bad != 0;
}
