//go:build amd64 && !purego

#include "textflag.h"

// func transpose8x8(dst *byte, dstStride, dstStep uintptr, src *byte, srcStride, srcStep uintptr, tiles int)
//
// Transposes tiles 8 × 8 tiles of 16-bit elements, src and dst advancing
// srcStep and dstStep octets from one tile to the next: each tile is
// eight unaligned loads, three rounds of unpacks (words, double words,
// quad words) and eight unaligned stores, SSE2 only.
TEXT ·transpose8x8(SB), NOSPLIT, $0-56
	MOVQ dst+0(FP), DI
	MOVQ dstStride+8(FP), DX
	MOVQ dstStep+16(FP), R12
	MOVQ src+24(FP), SI
	MOVQ srcStride+32(FP), BX
	MOVQ srcStep+40(FP), R13
	MOVQ tiles+48(FP), CX
	TESTQ CX, CX
	JZ   done
	LEAQ (BX)(BX*2), R8 // 3 × srcStride
	LEAQ (DX)(DX*2), R9 // 3 × dstStride

loop:
	// rows 0-7 of the tile
	MOVOU (SI), X0
	MOVOU (SI)(BX*1), X1
	MOVOU (SI)(BX*2), X2
	MOVOU (SI)(R8*1), X3
	LEAQ  (SI)(BX*4), R10
	MOVOU (R10), X4
	MOVOU (R10)(BX*1), X5
	MOVOU (R10)(BX*2), X6
	MOVOU (R10)(R8*1), X7

	// words: t0 = lo(r0,r1) .. t7 = hi(r6,r7)
	MOVO      X0, X8
	PUNPCKLWL X1, X0 // t0
	PUNPCKHWL X1, X8 // t1
	MOVO      X2, X9
	PUNPCKLWL X3, X2 // t2
	PUNPCKHWL X3, X9 // t3
	MOVO      X4, X10
	PUNPCKLWL X5, X4 // t4
	PUNPCKHWL X5, X10 // t5
	MOVO      X6, X11
	PUNPCKLWL X7, X6 // t6
	PUNPCKHWL X7, X11 // t7

	// double words
	MOVO      X0, X1
	PUNPCKLLQ X2, X0 // u0: columns 0,1 of rows 0-3
	PUNPCKHLQ X2, X1 // u1: columns 2,3
	MOVO      X8, X3
	PUNPCKLLQ X9, X8 // u2: columns 4,5
	PUNPCKHLQ X9, X3 // u3: columns 6,7
	MOVO      X4, X5
	PUNPCKLLQ X6, X4 // u4: columns 0,1 of rows 4-7
	PUNPCKHLQ X6, X5 // u5
	MOVO      X10, X7
	PUNPCKLLQ X11, X10 // u6
	PUNPCKHLQ X11, X7  // u7

	// quad words: the columns
	MOVO       X0, X2
	PUNPCKLQDQ X4, X0 // column 0
	PUNPCKHQDQ X4, X2 // column 1
	MOVO       X1, X6
	PUNPCKLQDQ X5, X1 // column 2
	PUNPCKHQDQ X5, X6 // column 3
	MOVO       X8, X9
	PUNPCKLQDQ X10, X8 // column 4
	PUNPCKHQDQ X10, X9 // column 5
	MOVO       X3, X11
	PUNPCKLQDQ X7, X3  // column 6
	PUNPCKHQDQ X7, X11 // column 7

	MOVOU X0, (DI)
	MOVOU X2, (DI)(DX*1)
	MOVOU X1, (DI)(DX*2)
	MOVOU X6, (DI)(R9*1)
	LEAQ  (DI)(DX*4), R11
	MOVOU X8, (R11)
	MOVOU X9, (R11)(DX*1)
	MOVOU X3, (R11)(DX*2)
	MOVOU X11, (R11)(R9*1)

	ADDQ R13, SI
	ADDQ R12, DI
	DECQ CX
	JNZ  loop

done:
	RET
