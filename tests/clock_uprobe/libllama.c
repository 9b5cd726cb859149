/* Stand-in for llama.cpp's libllama.so: exports two of the functions clockfloor probes. */
#include <unistd.h>

int llama_decode(void *ctx, long call_us) {
    (void)ctx;
    if (call_us > 0) usleep(call_us); /* a long call (e.g. a big prefill) must keep the floor up */
    return 0;
}

int llama_synchronize(void *ctx) {
    (void)ctx;
    return 0;
}
