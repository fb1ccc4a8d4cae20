/* The K-quant layouts kquant_gemm.c multiplies and kquant_dequant.c decodes (described at the top
 * of kquant_gemm.c): values per super-block and code bytes per repacked block. */
#ifndef TESSERA_KQUANT_H
#define TESSERA_KQUANT_H

#define KQ_BLOCK 256
#define Q6K_CODE_BYTES 192
#define Q4K_CODE_BYTES 128

#endif
