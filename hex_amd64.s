//go:build amd64 && !purego

#include "textflag.h"

DATA hexLowNibble<>+0(SB)/8, $0x0f0f0f0f0f0f0f0f
DATA hexLowNibble<>+8(SB)/8, $0x0f0f0f0f0f0f0f0f
GLOBL hexLowNibble<>(SB), RODATA|NOPTR, $16
DATA hexNine<>+0(SB)/8, $0x0909090909090909
DATA hexNine<>+8(SB)/8, $0x0909090909090909
GLOBL hexNine<>(SB), RODATA|NOPTR, $16
DATA hexZero<>+0(SB)/8, $0x3030303030303030
DATA hexZero<>+8(SB)/8, $0x3030303030303030
GLOBL hexZero<>(SB), RODATA|NOPTR, $16
DATA hexLetterGap<>+0(SB)/8, $0x2727272727272727
DATA hexLetterGap<>+8(SB)/8, $0x2727272727272727
GLOBL hexLetterGap<>(SB), RODATA|NOPTR, $16

// func hexBlocks(dst, src *byte, n int)
TEXT ·hexBlocks(SB), NOSPLIT, $0-24
	MOVQ  dst+0(FP), DI
	MOVQ  src+8(FP), SI
	MOVQ  n+16(FP), CX
	MOVOU hexLowNibble<>(SB), X7
	MOVOU hexNine<>(SB), X8
	MOVOU hexZero<>(SB), X9
	MOVOU hexLetterGap<>(SB), X10

loop:
	MOVOU (SI), X0
	MOVO  X0, X1
	PSRLW $4, X1
	PAND  X7, X1      // high nibbles
	PAND  X7, X0      // low nibbles
	MOVO  X1, X2
	PUNPCKLBW X0, X2  // octets 0-7: high, low, high, low...
	PUNPCKHBW X0, X1  // octets 8-15

	// A nibble n becomes '0'+n, plus 'a'-'0'-10 = 39 when n > 9.
	MOVO    X2, X3
	PCMPGTB X8, X3
	PAND    X10, X3
	PADDB   X9, X2
	PADDB   X3, X2
	MOVO    X1, X4
	PCMPGTB X8, X4
	PAND    X10, X4
	PADDB   X9, X1
	PADDB   X4, X1

	MOVOU X2, (DI)
	MOVOU X1, 16(DI)
	ADDQ  $16, SI
	ADDQ  $32, DI
	DECQ  CX
	JNZ   loop
	RET
