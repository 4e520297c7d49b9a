/* graph.c — CUDA-graph capture: begin on a stream in thread-local mode, end and
 * instantiate, launch, destroy; counts the thread's capture depth
 * (wf_tl_capture_depth, src/core/capture.c) that the other layers read. */
#include "cuda_internal.h"

#include <stdlib.h>

#if WEFT_HAVE_CUDA

struct weft_cuda_graph {
  cudaGraphExec_t exec;
  int dev;
};

int weft_cuda_graph_begin(void *stream) {
  int rc, dev;
  if ((rc = wf_cuda_device(&dev))) return rc;
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  if (!s)
    return wf_error(WEFT_EINVAL, "graph capture: cannot capture the legacy default stream; "
                    "capture on a stream from weft_cuda_stream_create");
  enum cudaStreamCaptureStatus st;
  WF_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
  if (st != cudaStreamCaptureStatusNone)
    return wf_error(WEFT_ESTATE, "graph capture: the stream is already capturing");
  WF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  wf_tl_capture_depth++;
  return 0;
}

int weft_cuda_graph_end(void *stream, weft_cuda_graph **out) {
  /* Whatever happens below, this thread's capture is over. */
  if (wf_tl_capture_depth > 0) wf_tl_capture_depth--;
  WF_CHECK_ARG(out, "graph end: NULL out-parameter");
  *out = NULL;
  int rc, dev;
  if ((rc = wf_cuda_device(&dev))) return rc;
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  WF_CHECK_ARG(s, "graph end: the legacy default stream never captures");
  enum cudaStreamCaptureStatus st;
  WF_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
  if (st == cudaStreamCaptureStatusNone)
    return wf_error(WEFT_ESTATE, "graph end: the stream is not capturing");
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(s, &graph);
  if (e != cudaSuccess || st == cudaStreamCaptureStatusInvalidated) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return wf_error(WEFT_ECUDA, "graph end: the capture was invalidated (%s): an operation "
                    "inside it was not capturable (a synchronizing call, the legacy stream, "
                    "or work from another thread)", cudaGetErrorString(e));
  }
  cudaGraphExec_t exec = NULL;
  e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "cudaGraphInstantiate", e);
  weft_cuda_graph *g = malloc(sizeof *g);
  if (!g) {
    cudaGraphExecDestroy(exec);
    return wf_error(WEFT_ENOMEM, "graph end: out of host memory");
  }
  g->exec = exec;
  g->dev = dev;
  *out = g;
  return 0;
}

int weft_cuda_graph_launch(weft_cuda_graph *g, void *stream) {
  WF_CHECK_ARG(g, "graph launch: NULL graph (destroyed?)");
  int rc, dev;
  if ((rc = wf_cuda_device(&dev))) return rc;
  if (dev != g->dev)
    return wf_error(WEFT_EINVAL, "graph launch: graph was captured on cuda:%d, current is cuda:%d",
                    g->dev, dev);
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  WF_CUDA_CHECK(cudaGraphLaunch(g->exec, s));
  return 0;
}

int weft_cuda_graph_destroy(weft_cuda_graph *g) {
  if (!g) return 0;
  cudaGraphExecDestroy(g->exec);
  free(g);
  return 0;
}

int weft_cuda_stream_capturing(void *stream, int *capturing) {
  WF_CHECK_ARG(capturing, "stream capturing: NULL out-parameter");
  *capturing = 0;
  int rc, dev;
  if ((rc = wf_cuda_device(&dev))) return rc;
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  enum cudaStreamCaptureStatus st;
  cudaError_t e = cudaStreamIsCapturing(s, &st);
  if (e == cudaErrorStreamCaptureImplicit) {
    /* the legacy stream, while a blocking stream captures */
    cudaGetLastError();
    *capturing = 1;
    return 0;
  }
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "cudaStreamIsCapturing", e);
  *capturing = st != cudaStreamCaptureStatusNone;
  return 0;
}

#endif /* WEFT_HAVE_CUDA */
