/* memvisor_dma_map_raw with a NULL host address: "NULL pointers where one is required ... are
 * -EINVAL" (the header), nothing mapped. A mapping there would translate to address 0. */
#include <errno.h>
#include <stdint.h>

#include "check.h"

int main(void) {
    memvisor_dma *dma;
    OK(memvisor_dma_new(0, &dma));
    FAILS(memvisor_dma_map_raw(dma, 0, NULL, PAGE, MEMVISOR_PROT_RW), EINVAL, "hva");
    void *hva = NULL;
    CHECK(memvisor_dma_translate(dma, 0, 8, MEMVISOR_PROT_READ, &hva, NULL) < 0);
    memvisor_dma_free(dma);
    puts("ok: map_raw_null");
    return 0;
}
