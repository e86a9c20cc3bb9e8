/* Test support: a plugin-EP library that stands in for OpenVINO's ONNX Runtime plugin and presents the CPU to it
 * with the vendor id the plugin accepts, so the same ONNX Runtime and the same OpenVINO plugin run the same tests on
 * a CPU of any vendor.
 *
 * Why: OpenVINOEpPluginFactory::GetSupportedDevices (onnxruntime/core/providers/openvino/ov_factory.cc) skips every
 * OrtHardwareDevice whose vendor id is not Intel's 0x8086, while OpenVINO itself runs on other x86-64 CPUs.
 *
 * How: ONNX Runtime loads this library (register_execution_provider_library) and calls CreateEpFactories with its
 * real OrtApiBase. We dlopen the OpenVINO plugin (SHIM_TARGET, fixed at build time) and forward CreateEpFactories /
 * ReleaseEpFactory to it, handing it an OrtApiBase of our own whose GetApi returns a copy of ORT's OrtApi table in
 * which HardwareDevice_VendorId answers SHIM_VENDOR_ID for CPU devices. Every other slot is ORT's own function, so
 * the plugin runs unchanged on the real graphs; ORT's own table (what sessions and Python see) is untouched.
 *
 * The declarations below are the few we need, written from include/onnxruntime/core/session/onnxruntime_c_api.h
 * (OrtApiBase: GetApi, GetVersionString; OrtApi is an append-only table of function pointers) and
 * onnxruntime_ep_c_api.h (CreateEpApiFactoriesFn, ReleaseEpApiFactoryFn). Slot numbers are those of ORT 1.31.1,
 * whose table the build refuses to patch for any other version (tests/plugin_ep.py checks the version first):
 * HardwareDevice_Type is slot 307, HardwareDevice_VendorId slot 308; the table has 441 slots. */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifndef SHIM_TARGET
#error "build with -DSHIM_TARGET=\"<path of the OpenVINO plugin library>\""
#endif
#ifndef SHIM_VENDOR_ID
#define SHIM_VENDOR_ID 0x8086
#endif

#define API_SLOTS 441
#define SLOT_DEVICE_TYPE 307
#define SLOT_DEVICE_VENDOR_ID 308
#define DEVICE_TYPE_CPU 0 /* OrtHardwareDeviceType_CPU */

typedef void OrtStatus;
typedef void OrtLogger;
typedef void OrtEpFactory;
typedef void OrtHardwareDevice;
typedef void (*Slot)(void);

typedef struct OrtApiBase {
  const Slot *(*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

typedef OrtStatus *(*CreateFn)(const char *registration_name, const OrtApiBase *ort_api_base,
                               const OrtLogger *default_logger, OrtEpFactory **factories, size_t max_factories,
                               size_t *num_factories);
typedef OrtStatus *(*ReleaseFn)(OrtEpFactory *factory);
typedef int (*DeviceTypeFn)(const OrtHardwareDevice *device);
typedef uint32_t (*VendorIdFn)(const OrtHardwareDevice *device);

static const OrtApiBase *real_base;
static const Slot *real_api;
static Slot patched_api[API_SLOTS];
static void *target;
static CreateFn target_create;
static ReleaseFn target_release;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static uint32_t presented_vendor_id(const OrtHardwareDevice *device) {
  DeviceTypeFn type = (DeviceTypeFn)real_api[SLOT_DEVICE_TYPE];
  VendorIdFn vendor = (VendorIdFn)real_api[SLOT_DEVICE_VENDOR_ID];
  return type(device) == DEVICE_TYPE_CPU ? (uint32_t)SHIM_VENDOR_ID : vendor(device);
}

static const Slot *shim_get_api(uint32_t version) {
  const Slot *api = real_base->GetApi(version);
  if (api == NULL) return NULL;
  pthread_mutex_lock(&lock);
  real_api = api;
  memcpy(patched_api, api, sizeof(patched_api));
  patched_api[SLOT_DEVICE_VENDOR_ID] = (Slot)presented_vendor_id;
  pthread_mutex_unlock(&lock);
  return patched_api;
}

static const char *shim_version_string(void) { return real_base->GetVersionString(); }

static const OrtApiBase shim_base = {shim_get_api, shim_version_string};

static int load_target(void) {
  if (target != NULL) return 1;
  target = dlopen(SHIM_TARGET, RTLD_NOW | RTLD_LOCAL);
  if (target == NULL) {
    fprintf(stderr, "sdserve vendor shim: cannot load %s: %s\n", SHIM_TARGET, dlerror());
    return 0;
  }
  target_create = (CreateFn)dlsym(target, "CreateEpFactories");
  target_release = (ReleaseFn)dlsym(target, "ReleaseEpFactory");
  if (target_create == NULL || target_release == NULL) {
    fprintf(stderr, "sdserve vendor shim: %s exports no CreateEpFactories/ReleaseEpFactory\n", SHIM_TARGET);
    return 0;
  }
  return 1;
}

__attribute__((visibility("default"))) OrtStatus *CreateEpFactories(const char *registration_name,
                                                                   const OrtApiBase *ort_api_base,
                                                                   const OrtLogger *default_logger,
                                                                   OrtEpFactory **factories, size_t max_factories,
                                                                   size_t *num_factories) {
  real_base = ort_api_base;
  if (!load_target()) {
    /* ORT's CreateStatus (slot 0, ORT_FAIL = 1) says why, as any plugin's failure would. */
    typedef OrtStatus *(*CreateStatusFn)(int code, const char *msg);
    const Slot *api = ort_api_base->GetApi(1);
    return ((CreateStatusFn)api[0])(1, "sdserve vendor shim: the OpenVINO plugin library does not load");
  }
  return target_create(registration_name, &shim_base, default_logger, factories, max_factories, num_factories);
}

__attribute__((visibility("default"))) OrtStatus *ReleaseEpFactory(OrtEpFactory *factory) {
  return target_release(factory);
}
