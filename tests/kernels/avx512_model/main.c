/* The one-row and the many-row 512-bit int4 kernels (q4_row512, q4_block512; pasted before this by the test) on the
 * same weights and activations: every output the same bits, and near a double-precision sum of the same codes.
 * Prints "<bad> of <outputs> outputs differ"; exits 1 if any does. */
static uint16_t f2h(float f) { return (uint16_t)_cvtss_sh(f, 0); }
int main(void) {
    srand(7);
    int bad = 0, cases = 0;
    int64_t Ks[] = {256, 320, 576, 1536, 3072};
    for (int ki = 0; ki < 5; ki++) {
        const int64_t K = Ks[ki], G = K / 32, N = 7, M = 5;
        uint8_t *q = malloc(N * K / 2); uint16_t *d = malloc(N * G * 2), *mn = malloc(N * G * 2);
        float *x = malloc(M * K * 4), *bias = malloc(N * 4);
        for (int64_t i = 0; i < N * K / 2; i++) q[i] = rand() & 255;
        for (int64_t i = 0; i < N * G; i++) { d[i] = f2h((rand() % 1000) * 1e-5f); mn[i] = f2h(((rand() % 1000) - 500) * 1e-4f); }
        for (int64_t i = 0; i < M * K; i++) x[i] = ((rand() % 20001) - 10000) * 1e-3f;
        for (int64_t i = 0; i < N; i++) bias[i] = ((rand() % 2001) - 1000) * 1e-3f;
        int16_t *xq = malloc(M * K * 2), *xp = malloc(M * K * 2); float sx[8], *xsum = malloc(M * G * 4);
        quantize_rows(x, M, K, 32, xq, sx, xsum);
        for (int64_t m = 0; m < M; m++) pair_order(xq + m * K, K / 32 / 8 * 8, xp + m * K);
        float *many = malloc(M * N * 4);
        for (int64_t n = 0; n < N; n += RB) {
            int rows = N - n < RB ? (int)(N - n) : RB;
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) q4_block512(xq, xp, sx, xsum, m, 2, K, q, d, mn, N, n, rows, bias, many);
            if (m < M) q4_block512(xq, xp, sx, xsum, m, 1, K, q, d, mn, N, n, rows, bias, many);
        }
        for (int64_t m = 0; m < M; m++) {
            /* one row, prepared as tkv_rows_prepare does for M = 1 */
            int16_t xq1[4096], xp1[4096]; float sx1, xs1[128];
            quantize_rows(x + m * K, 1, K, 32, xq1, &sx1, xs1);
            pair_order(xq1, K / 32 / 8 * 8, xp1);
            for (int64_t n = 0; n < N; n++) {
                float one = q4_row512(q + n * (K / 2), xq1, xp1, xs1, d + n * G, mn + n * G, G, sx1, bias[n]);
                /* a double reference of the same integer codes, for sanity */
                double ref = bias[n];
                for (int64_t b = 0; b < G; b++) {
                    long s = 0;
                    for (int j = 0; j < 16; j++) { uint8_t v = q[n * (K / 2) + b * 16 + j]; s += (long)(v & 15) * xq1[b * 32 + j] + (long)(v >> 4) * xq1[b * 32 + 16 + j]; }
                    ref += (double)s * h2f(d[n * G + b]) * sx1 + (double)h2f(mn[n * G + b]) * xs1[b];
                }
                cases++;
                if (memcmp(&one, &many[m * N + n], 4) != 0 || fabs(one - ref) > 1e-4 * (fabs(ref) + 1)) {
                    bad++;
                    if (bad < 10) printf("K %ld m %ld n %ld: one %.9g many %.9g ref %.9g\n", (long)K, (long)m, (long)n, one, many[m * N + n], ref);
                }
            }
        }
    }
    printf("%d of %d outputs differ\n", bad, cases);
    return bad != 0;
}
