#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# scripts/resident-kernel-emulate.py — a lane-level emulation (fp64, numpy) of the index
# arithmetic of the resident attention kernel (include/writescope/cuda/kernels_resident.cuh):
# the per-lane Q fragments, the ldmatrix (plain and .trans) addresses, the m16n8k16 fragment
# layouts, the warp-split score sums, the quad-wise online softmax, the P re-pack and the
# epilogue, compared with plain attention. It checks the fragment mapping without a GPU (no
# hi/lo split: precision is not its subject). Usage: python3 scripts/resident-kernel-emulate.py
# (prints the largest error per shape; all should be ~1e-15 with no unwritten element).
import numpy as np
rng=np.random.default_rng(1)
def run(R,V,W,T,ntok_total,shared,gc):
    KS=R//16; KPW=(KS+W-1)//W; NT=T//8; VW=V//W; NTV=VW//8
    Q=np.zeros((16,R)); Q[:gc]=rng.uniform(-1,1,(gc,R))
    Kall=rng.uniform(-1,1,(ntok_total,R)); Vall=Kall[:,:V] if shared else rng.uniform(-1,1,(ntok_total,V))
    def lds(mat, addr, trans):
        # addr[l] = (row,col) per lane; returns regs[l][mi] = pair
        regs=[[None]*4 for _ in range(32)]
        for mi in range(4):
            M=np.array([mat[addr[8*mi+r][0], addr[8*mi+r][1]:addr[8*mi+r][1]+8] for r in range(8)])
            for i in range(32):
                if not trans: regs[i][mi]=(M[i//4][2*(i%4)],M[i//4][2*(i%4)+1])
                else: regs[i][mi]=(M[2*(i%4)][i//4],M[2*(i%4)+1][i//4])
        return regs
    def mma(c,a,b0,b1):
        A=np.zeros((16,16)); B=np.zeros((16,8))
        for l in range(32):
            g,t=l//4,l%4
            for j in range(2):
                A[g][2*t+j]=a[l][0][j]; A[g+8][2*t+j]=a[l][1][j]; A[g][2*t+8+j]=a[l][2][j]; A[g+8][2*t+8+j]=a[l][3][j]
                B[2*t+j][g]=b0[l][j]; B[2*t+8+j][g]=b1[l][j]
        Cm=A@B
        for l in range(32):
            g,t=l//4,l%4
            for j in range(2): c[l][j]+=Cm[g][2*t+j]; c[l][2+j]+=Cm[g+8][2*t+j]
    # q frags per warp
    qf=[[[None]*4 for _ in range(32)] for _ in range(W*KPW)]
    for w in range(W):
        for kk in range(KPW):
            ks=w*KPW+kk
            for l in range(32):
                gr,tq=l//4,l%4
                for h in range(2):
                    row=gr+8*h
                    if ks<KS and row<gc:
                        k0=(Q[row][ks*16+2*tq],Q[row][ks*16+2*tq+1]); k8=(Q[row][ks*16+2*tq+8],Q[row][ks*16+2*tq+9])
                    else: k0=k8=(0.,0.)
                    qf[ks if ks<W*KPW else 0][l][h]=k0; qf[ks][l][2+h]=k8
    m=np.full((W,32,2),-np.inf); lsum=np.zeros((W,32,2)); acc=np.zeros((W,NTV,32,4))
    ntiles=(ntok_total+T-1)//T
    for tt in range(ntiles):
        n=min(T,ntok_total-tt*T)
        Kt=np.zeros((T,R+8)); Kt[:n,:R]=Kall[tt*T:tt*T+n]
        Vt=np.zeros((T,R+8)); Vt[:n,:V]=Vall[tt*T:tt*T+n]
        red=np.zeros((W,NT,32,4))
        for w in range(W):
            s=[[[0.]*4 for _ in range(32)] for _ in range(NT)]
            for kk in range(KPW):
                ks=w*KPW+kk
                if ks>=KS: continue
                for jp in range(NT//2):
                    addr=[(16*jp+8*((l>>3)>>1)+(l&7), ks*16+8*((l>>3)&1)) for l in range(32)]
                    b=lds(Kt,addr,False)
                    mma(s[2*jp],qf[ks],[b[l][0] for l in range(32)],[b[l][1] for l in range(32)])
                    mma(s[2*jp+1],qf[ks],[b[l][2] for l in range(32)],[b[l][3] for l in range(32)])
            red[w]=np.array(s)
        S=red.sum(0)  # [NT][32][4]
        for w in range(W):
            s=S.copy()
            for l in range(32):
                tq=l%4
                for j in range(NT):
                    for e in range(4):
                        if 8*j+2*tq+(e&1)>=n: s[j][l][e]=-np.inf
            # quad max
            mx=np.full((32,2),-np.inf)
            for l in range(32):
                for j in range(NT):
                    for e in range(4): mx[l][e>>1]=max(mx[l][e>>1],s[j][l][e])
            mxq=mx.copy()
            for l in range(32): mxq[l]=np.max(mx[(l//4)*4:(l//4)*4+4],axis=0)
            mnew=np.maximum(m[w],mxq); alpha=np.where(m[w]==-np.inf,0,np.exp(m[w]-mnew)); m[w]=mnew
            p=np.where(s==-np.inf,0,np.exp(s-mnew[None,:,[0,0,1,1]]))
            rs=p.sum(0)  # [32][4]
            rs2=np.stack([rs[:,0]+rs[:,1],rs[:,2]+rs[:,3]],1)
            rsq=np.array([rs2[(l//4)*4:(l//4)*4+4].sum(0) for l in range(32)])
            lsum[w]=lsum[w]*alpha+rsq
            for j in range(NTV):
                acc[w][j][:,0]*=alpha[:,0]; acc[w][j][:,1]*=alpha[:,0]; acc[w][j][:,2]*=alpha[:,1]; acc[w][j][:,3]*=alpha[:,1]
            for kk in range(T//16):
                pf=[[(p[2*kk][l][0],p[2*kk][l][1]),(p[2*kk][l][2],p[2*kk][l][3]),(p[2*kk+1][l][0],p[2*kk+1][l][1]),(p[2*kk+1][l][2],p[2*kk+1][l][3])] for l in range(32)]
                for jp in range(NTV//2):
                    addr=[(16*kk+8*((l>>3)&1)+(l&7), w*VW+16*jp+8*((l>>3)>>1)) for l in range(32)]
                    b=lds(Vt,addr,True)
                    c0=[list(x) for x in acc[w][2*jp]]; c1=[list(x) for x in acc[w][2*jp+1]]
                    mma(c0,pf,[b[l][0] for l in range(32)],[b[l][1] for l in range(32)])
                    mma(c1,pf,[b[l][2] for l in range(32)],[b[l][3] for l in range(32)])
                    acc[w][2*jp]=np.array(c0); acc[w][2*jp+1]=np.array(c1)
    O=np.full((16,V),np.nan); LSE=np.full(16,np.nan)
    for w in range(W):
        for l in range(32):
            gr,tq=l//4,l%4
            for h in range(2):
                row=gr+8*h
                if row<gc:
                    inv=1/lsum[w][l][h] if lsum[w][l][h]>0 else 0
                    for j in range(NTV):
                        O[row][w*VW+8*j+2*tq]=acc[w][j][l][2*h]*inv; O[row][w*VW+8*j+2*tq+1]=acc[w][j][l][2*h+1]*inv
                    if w==0 and tq==0: LSE[row]=m[w][l][h]+np.log(lsum[w][l][h]) if lsum[w][l][h]>0 else -np.inf
    # reference
    Sref=Q[:gc]@Kall.T; mref=Sref.max(1,keepdims=True); P=np.exp(Sref-mref); Oref=(P@Vall)/P.sum(1,keepdims=True)
    lref=mref[:,0]+np.log(P.sum(1))
    print(R,V,T,ntok_total,shared,gc, "maxerr O", np.abs(O[:gc]-Oref).max(), "lse", np.abs(LSE[:gc]-lref).max(), "unwritten", np.isnan(O[:gc]).sum())
run(128,128,4,32,45,False,8)
run(128,128,4,32,32,False,16)
run(576,512,4,32,37,True,16)
run(64,64,4,32,20,False,5)
run(160,128,4,32,70,True,11)
run(128,128,4,32,1,False,8)
