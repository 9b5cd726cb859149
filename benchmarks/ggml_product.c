// llama.cpp's own product of one block type, for `llamacpp.py products --against-llamacpp`: M rows (default 1) of
// float32 activations against an N x K matrix of that type through ggml's CPU backend (ggml_mul_mat, the path llama.cpp's
// decode and prompts take with --repack 0: activations quantized to the type's dot type, then one vec_dot an output
// element, or llamafile's tinyBLAS where it takes the type). The weights are
// random floats quantized by ggml itself, so every block is one ggml would write.
//
//     ggml_product TYPE N K THREADS CALLS [M]    (TYPE as ggml names it: q4_K, q6_K, q8_0, mxfp4, ...)
//
// Prints {"type": TYPE, "gb_per_s": ..., "g_weights_per_s": ...} from the median of CALLS computes.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int by_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    fprintf(stderr, "usage: %s TYPE N K THREADS CALLS [M]\n", argv[0]);
    return 2;
  }
  const int64_t n = atoll(argv[2]), k = atoll(argv[3]);
  const int threads = atoi(argv[4]), calls = atoi(argv[5]);
  const int64_t m = argc == 7 ? atoll(argv[6]) : 1;
  int type = -1;
  for (int t = 0; t < GGML_TYPE_COUNT; t++) {
    const char* name = ggml_type_name((enum ggml_type)t);
    if (name && strcmp(name, argv[1]) == 0) type = t;
  }
  if (type < 0 || k % ggml_blck_size((enum ggml_type)type) != 0) {
    fprintf(stderr, "%s: unknown type, or K=%lld is not a multiple of its block\n", argv[1], (long long)k);
    return 2;
  }
  ggml_cpu_init();
  const size_t wbytes = ggml_row_size((enum ggml_type)type, k) * n;
  struct ggml_init_params params = {wbytes + (size_t)(k + n) * m * 4 * 4 + (64u << 20), NULL, false};
  struct ggml_context* ctx = ggml_init(params);
  struct ggml_tensor* w = ggml_new_tensor_2d(ctx, (enum ggml_type)type, k, n);
  struct ggml_tensor* x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
  struct ggml_tensor* y = ggml_mul_mat(ctx, w, x);
  struct ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, y);

  float* src = malloc(sizeof(float) * k);
  srand(0);
  ggml_quantize_init((enum ggml_type)type);
  for (int64_t r = 0; r < n; r++) {
    for (int64_t i = 0; i < k; i++) src[i] = ((float)rand() / RAND_MAX - 0.5f) * 0.1f;
    ggml_quantize_chunk((enum ggml_type)type, src, (char*)w->data + r * w->nb[1], 0, 1, k, NULL);
  }
  for (int64_t i = 0; i < k * m; i++) ((float*)x->data)[i] = (float)rand() / RAND_MAX - 0.5f;
  free(src);

  struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
  struct ggml_threadpool* pool = ggml_threadpool_new(&tpp);
  struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
  plan.work_data = malloc(plan.work_size + 64);
  for (int i = 0; i < 5; i++) ggml_graph_compute(graph, &plan);
  double* times = malloc(sizeof(double) * calls);
  for (int i = 0; i < calls; i++) {
    const double start = now();
    ggml_graph_compute(graph, &plan);
    times[i] = now() - start;
  }
  qsort(times, calls, sizeof(double), by_double);
  const double t = times[calls / 2];
  printf("{\"type\": \"%s\", \"gb_per_s\": %.4f, \"g_weights_per_s\": %.4f, \"check\": %.6g}\n", argv[1],
         wbytes / t / 1e9, (double)n * k * m / t / 1e9, ((float*)y->data)[0]);
  ggml_threadpool_free(pool);
  ggml_free(ctx);
  return 0;
}
