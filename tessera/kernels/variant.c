/* Which variant of the library this build is (simd.h's TESSERA_VARIANT): library.py checks that a
 * variant's flags gave it the level it was built for, and tests assert which variant ran. */
#include "simd.h"
#include "tessera_kernels.h"

const char *tessera_variant(void) { return TESSERA_VARIANT; }
