/* prefill_worker: the worker runtime (worker/worker.h) in role prefill unless --role says
 * otherwise. */
#include "worker.h"

int main(int argc, char **argv)
{
    return worker_main(PROTO_ROLE_PREFILL, argc, argv);
}
