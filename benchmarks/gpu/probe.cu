// What a process sees of the GPU, and what the GPU work a training step is made of costs, printed as one JSON line.
// The same binary runs natively and inside a container (fast path and P1), so the two can be compared in one run:
// it needs only the driver's libcuda.so.1 (what `udocker setup --nvidia` copies in) and the C library.
//
//   gpu_probe info     devices, names, memory, the driver's version, and a kernel whose result is checked
//   gpu_probe bench    launch + synchronize latency, allocation, host<->device copies, an FMA-bound kernel
//
// Build: see testbed/gpukit.py's build_probe (nvcc, the CUDA runtime linked statically).
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// A failed CUDA call ends the probe with a JSON error that names the call (the tests read it).
#define CHECK(call)                                                                                    \
  do {                                                                                                 \
    cudaError_t e_ = (call);                                                                           \
    if (e_ != cudaSuccess) {                                                                           \
      printf("{\"ok\": false, \"call\": \"%s\", \"error\": \"%s\"}\n", #call, cudaGetErrorString(e_)); \
      return 3;                                                                                        \
    }                                                                                                  \
  } while (0)

__global__ void add(const float *a, const float *b, float *c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}

__global__ void empty(void) {}

// FMA-bound: each thread runs `iters` dependent multiply-adds on 4 independent chains (2 flops each).
__global__ void fma_loop(float *out, int iters) {
  float a = threadIdx.x * 1e-3f, b = a + 1, c = a + 2, d = a + 3;
  for (int i = 0; i < iters; i++) {
    a = a * 0.9999f + 0.0001f;
    b = b * 0.9999f + 0.0001f;
    c = c * 0.9999f + 0.0001f;
    d = d * 0.9999f + 0.0001f;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = a + b + c + d;
}

static int info(void) {
  int count = 0, driver = 0;
  CHECK(cudaDriverGetVersion(&driver));
  if (cudaGetDeviceCount(&count) == cudaErrorNoDevice) count = 0;  // CUDA_VISIBLE_DEVICES="" hides them all
  else CHECK(cudaGetDeviceCount(&count));
  printf("{\"ok\": true, \"driver\": %d, \"count\": %d, \"devices\": [", driver, count);
  for (int d = 0; d < count; d++) {
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, d));
    printf("%s{\"name\": \"%s\", \"memory_mib\": %zu, \"sm\": %d, \"cc\": \"%d.%d\"}", d ? ", " : "", p.name,
           p.totalGlobalMem >> 20, p.multiProcessorCount, p.major, p.minor);
  }
  printf("]");
  if (count) {  // a kernel on device 0, its result checked on the host
    const int n = 1 << 20;
    float *a, *b, *c, *h = (float *)malloc(n * sizeof(float));
    CHECK(cudaMalloc(&a, n * sizeof(float)));
    CHECK(cudaMalloc(&b, n * sizeof(float)));
    CHECK(cudaMalloc(&c, n * sizeof(float)));
    for (int i = 0; i < n; i++) h[i] = (float)i;
    CHECK(cudaMemcpy(a, h, n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, h, n * sizeof(float), cudaMemcpyHostToDevice));
    add<<<(n + 255) / 256, 256>>>(a, b, c, n);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h, c, n * sizeof(float), cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int i = 0; i < n; i++) wrong += h[i] != 2.0f * i;
    printf(", \"kernel_ok\": %s", wrong ? "false" : "true");
    cudaFree(a), cudaFree(b), cudaFree(c), free(h);
  }
  printf("}\n");
  return 0;
}

static int bench(void) {
  float *dev, *out, *host;
  const size_t bytes = (size_t)256 << 20;
  CHECK(cudaFree(0));  // the context, outside the timings
  CHECK(cudaMalloc(&dev, bytes));
  CHECK(cudaMalloc(&out, 132 * 1024 * 256 * sizeof(float)));
  host = (float *)malloc(bytes);
  memset(host, 1, bytes);
  for (int i = 0; i < 100; i++) empty<<<1, 1>>>();  // warm-up
  CHECK(cudaDeviceSynchronize());

  const int launches = 5000;  // a kernel and a wait for it: a small training step's pattern, driver-bound
  double t = now();
  for (int i = 0; i < launches; i++) {
    empty<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
  }
  double launch_us = (now() - t) / launches * 1e6;

  const int allocs = 500;  // allocation and release: driver calls (ioctls) each
  t = now();
  for (int i = 0; i < allocs; i++) {
    void *p;
    CHECK(cudaMalloc(&p, 1 << 20));
    CHECK(cudaFree(p));
  }
  double alloc_us = (now() - t) / allocs * 1e6;

  const int copies = 8;  // pageable host memory, as a data loader hands it over
  t = now();
  for (int i = 0; i < copies; i++) CHECK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
  double h2d = copies * (double)bytes / (now() - t) / 1e9;
  t = now();
  for (int i = 0; i < copies; i++) CHECK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
  double d2h = copies * (double)bytes / (now() - t) / 1e9;

  const int iters = 20000, blocks = 132 * 1024, threads = 256;
  fma_loop<<<blocks, threads>>>(out, 10);
  CHECK(cudaDeviceSynchronize());
  t = now();
  fma_loop<<<blocks, threads>>>(out, iters);
  CHECK(cudaDeviceSynchronize());
  double tflops = 8.0 * iters * blocks * threads / (now() - t) / 1e12;

  printf("{\"ok\": true, \"launch_sync_us\": %.2f, \"malloc_free_us\": %.2f, \"h2d_gb_s\": %.2f, \"d2h_gb_s\": %.2f, "
         "\"fma_tflop_s\": %.2f}\n", launch_us, alloc_us, h2d, d2h, tflops);
  cudaFree(dev), cudaFree(out), free(host);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 2 && !strcmp(argv[1], "info")) return info();
  if (argc == 2 && !strcmp(argv[1], "bench")) return bench();
  fprintf(stderr, "usage: %s info|bench\n", argv[0]);
  return 2;
}
