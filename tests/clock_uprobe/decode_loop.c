/* A decode loop: llama_decode then llama_synchronize, forever.
 * argv[1]: microseconds spent inside llama_decode; argv[2]: microseconds between calls.
 * Further arguments (e.g. --cpu-moe) are only there to be seen in /proc/<pid>/cmdline. */
#include <stdlib.h>
#include <unistd.h>

int llama_decode(void *ctx, long call_us);
int llama_synchronize(void *ctx);

int main(int argc, char **argv) {
    long call_us = argc > 1 ? atol(argv[1]) : 0;
    long gap_us = argc > 2 ? atol(argv[2]) : 10000;
    for (;;) {
        llama_decode(0, call_us);
        llama_synchronize(0);
        usleep(gap_us);
    }
}
